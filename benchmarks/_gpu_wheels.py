"""The package lists of benchmarks/gpu_wheels.sh: which wheels the GPU machine needs besides its image.

    python benchmarks/_gpu_wheels.py stubs DIR [--assumed] [--left-behind]   # metadata-only wheels standing in for
                                                             # the image's packages (and polars)
    python benchmarks/_gpu_wheels.py lock REPORT.json        # gpu_wheels.txt from a `pip install --report` of neoembed
    python benchmarks/_gpu_wheels.py carried                 # the pins to download (one per line)
    python benchmarks/_gpu_wheels.py left-behind             # the carried names that stay behind (polars)
    python benchmarks/_gpu_wheels.py missing DIR             # the pins (polars aside) with no wheel in DIR
    python benchmarks/_gpu_wheels.py pack SRC DST            # a trained model's matrices as int8 rows, to carry
    python benchmarks/_gpu_wheels.py unpack SRC DST          # ... and back, every weight fp16-exact, on the GPU

benchmarks/gpu_image.txt lists the image's packages (pinned where the version is known). benchmarks/gpu_wheels.txt
lists what is carried (``name==version``) and, marked ``# image``, the image packages whose version is unknown
there but which a carried wheel requires: the version pip chose for them here, assumed, and checked on the GPU by
``pip check``. Only what neoembed reaches through packages the image lacks is carried: an image package's own
requirements are the image's business.
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
import sys
import zipfile
from pathlib import Path

from packaging.markers import Marker
from packaging.requirements import Requirement

HERE = Path(__file__).resolve().parent
IMAGE = HERE / "gpu_image.txt"
LOCK = HERE / "gpu_wheels.txt"
# the GPU machine: CPython 3.12.3 on Linux x86-64
ENV = {
    "python_version": "3.12",
    "python_full_version": "3.12.3",
    "sys_platform": "linux",
    "platform_system": "Linux",
    "platform_machine": "x86_64",
    "os_name": "posix",
    "implementation_name": "cpython",
    "platform_python_implementation": "CPython",
}


# polars (mteb imports it; retrieval tasks read their qrels with it) is a 54 MB wheel: with the tracked tree the
# device call would pass its 64 MiB, so it stays behind and benchmarks/gpu_shims/polars stands in for it.
LEFT_BEHIND = ("polars", "polars-runtime-32")


def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def read_pins(path: Path) -> dict[str, tuple[str | None, bool]]:
    """``{name: (version or None, marked '# image')}`` of a list file (comments and blank lines skipped)."""
    pins = {}
    for line in path.read_text(encoding="utf8").splitlines():
        spec, _, comment = line.partition("#")
        if not spec.strip():
            continue
        name, _, version = spec.strip().partition("==")
        pins[norm(name)] = (version or None, comment.strip() == "image")
    return pins


def image_packages() -> dict[str, str | None]:
    return {name: version for name, (version, _) in read_pins(IMAGE).items()}


def carried() -> dict[str, str]:
    return {name: version for name, (version, image) in read_pins(LOCK).items() if not image}


def stub_wheel(folder: Path, name: str, version: str) -> Path:
    """A wheel holding only metadata (no requirements): the image's installed package, as pip's resolver sees it."""
    dist = f"{name.replace('-', '_')}-{version}"
    files = {
        f"{dist}.dist-info/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
        f"{dist}.dist-info/WHEEL": "Wheel-Version: 1.0\nGenerator: neoembed-stub\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = []
    for path, text in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=").decode()
        record.append(f"{path},sha256={digest},{len(text.encode())}")
    files[f"{dist}.dist-info/RECORD"] = "\n".join([*record, f"{dist}.dist-info/RECORD,,"]) + "\n"
    out = folder / f"{dist}-py3-none-any.whl"
    with zipfile.ZipFile(out, "w") as z:
        for path, text in files.items():
            z.writestr(path, text)
    return out


def stubs(folder: Path, assumed: bool, left_behind: bool = False) -> None:
    """Stub wheels for the image's pinned packages; with ``assumed``, also for the image packages that
    gpu_wheels.txt gives an assumed version (the offline check resolves against exactly these); with
    ``left_behind``, for the carried packages that stay behind (polars: the shim stands in for it)."""
    folder.mkdir(parents=True, exist_ok=True)
    versions = {n: v for n, v in image_packages().items() if v}
    if assumed:
        versions |= {n: v for n, (v, image) in read_pins(LOCK).items() if image and v and n not in versions}
    if left_behind:
        versions |= {n: v for n, v in carried().items() if n in LEFT_BEHIND}
    for name, version in versions.items():
        # a local label ranks the stub above the index's same release (whose own requirements would be resolved)
        stub_wheel(folder, name, version if assumed else f"{version}+image")
    print(f"{len(versions)} stub wheels in {folder}")


def requirements(meta: dict, extras: set[str]) -> list[Requirement]:
    reqs = []
    for line in meta.get("requires_dist", []):
        req = Requirement(line)
        marker = req.marker or Marker("python_version > '0'")
        if any(marker.evaluate({**ENV, "extra": e}) for e in extras | {""}):
            reqs.append(req)
    return reqs


def lock(report: Path) -> str:
    """gpu_wheels.txt's text: the closure of neoembed's requirements through packages the image lacks."""
    items = {norm(i["metadata"]["name"]): i["metadata"] for i in json.loads(report.read_text())["install"]}
    image = image_packages()
    keep, assumed, todo, seen = {}, {}, [("neoembed", frozenset())], set()
    while todo:
        name, extras = todo.pop()
        if (name, extras) in seen:
            continue
        seen.add((name, extras))
        keep[name] = items[name]["version"]
        for req in requirements(items[name], set(extras)):
            dep = norm(req.name)
            if dep in image:
                if image[dep] is None:
                    assumed[dep] = items[dep]["version"]
            else:
                todo.append((dep, frozenset(req.extras)))
    lines = [
        "# Generated by `bash benchmarks/gpu_wheels.sh --lock`: the wheels carried to the GPU machine (neoembed is",
        "# built from the checkout). '# image': on the image, version unknown there; pip chose it here.",
    ]
    lines += [f"{n}=={v}" for n, v in sorted(keep.items()) if n != "neoembed"]
    lines += [f"{n}=={v}  # image" for n, v in sorted(assumed.items())]
    return "\n".join(lines) + "\n"


def missing(folder: Path) -> list[str]:
    """The pins of gpu_wheels.txt (neoembed's own wheel too, the first call's aside) without their wheel in
    ``folder``, and wheels there in another version than pinned."""
    have = {}
    for whl in folder.glob("*.whl"):
        name, version = whl.name.split("-")[:2]
        have.setdefault(norm(name), set()).add(version)
    want = {n: v for n, v in carried().items() if n not in LEFT_BEHIND}
    problems = [f"{n}=={v}: no wheel in {folder}" for n, v in want.items() if v not in have.get(n, set())]
    problems += [
        f"{n}: {sorted(v)} in {folder}, pinned {want[n]}" for n, v in have.items() if n in want and len(v) > 1
    ]
    if "neoembed" not in have:
        problems.append(f"neoembed: no wheel in {folder} (bash benchmarks/gpu_wheels.sh builds it)")
    return problems


PACKED = "model.int8.safetensors"


def pack(src: Path, dst: Path) -> None:
    """A copy of the model folder ``src`` whose ``model.safetensors`` is replaced by ``PACKED``: each matrix of
    at least 64k entries as int8 rows and a float32 scale per row (``max |row| / 127``), the rest float32.

    all-MiniLM-L6-v2's 90 MB of float32 become 23 MB: what fits beside the tracked tree in one device call. The
    model evaluated is then the trained one with its matrices rounded to 8 bits (benchmarks/mteb_precision.py's
    record says so), the same in both precisions: the comparison is of fp16 against fp32 arithmetic."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("model.safetensors", "*.bin", "onnx", "openvino"))
    out = {}
    for name, w in load_file(src / "model.safetensors").items():
        if w.is_floating_point() and w.dim() == 2 and w.numel() >= 65536:
            scale = w.float().abs().amax(dim=1).clamp_min(1e-12) / 127
            out[name + ":int8"] = (w.float() / scale[:, None]).round().clamp(-127, 127).to(torch.int8)
            out[name + ":scale"] = scale
        else:
            out[name] = w.float() if w.is_floating_point() else w
    save_file(out, dst / PACKED, metadata={"format": "pt"})
    print(f"{dst / PACKED}: {(dst / PACKED).stat().st_size} bytes")


def unpack(src: Path, dst: Path) -> None:
    """``pack``'s folder back to a loadable one: every floating weight float32 with a value float16 holds exactly
    (rounded through it), so that evaluating in fp16 and in fp32 uses the very same weights."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst, ignore=shutil.ignore_patterns(PACKED), dirs_exist_ok=True)
    packed, out = load_file(src / PACKED), {}
    for key, t in packed.items():
        if key.endswith(":scale"):
            continue
        if key.endswith(":int8"):
            name = key[: -len(":int8")]
            t = t.float() * packed[name + ":scale"][:, None]
        else:
            name = key
        out[name] = t.half().float() if t.is_floating_point() else t
    save_file(out, dst / "model.safetensors", metadata={"format": "pt"})
    print(f"{dst}: {len(out)} tensors, float32 holding float16 values")


def main() -> None:
    cmd, args = sys.argv[1], sys.argv[2:]
    if cmd == "stubs":
        stubs(Path(args[0]), "--assumed" in args, "--left-behind" in args)
    elif cmd == "lock":
        LOCK.write_text(lock(Path(args[0])), encoding="utf8")
        print(LOCK.read_text(encoding="utf8"), end="")
    elif cmd == "carried":
        print("\n".join(f"{n}=={v}" for n, v in carried().items()))
    elif cmd == "missing":
        problems = missing(Path(args[0]))
        print("".join(f"  {p}\n" for p in problems), end="")
        sys.exit(1 if problems else 0)
    elif cmd == "left-behind":
        print("\n".join(LEFT_BEHIND))
    elif cmd == "pack":
        pack(Path(args[0]), Path(args[1]))
    elif cmd == "unpack":
        unpack(Path(args[0]), Path(args[1]))
    else:
        sys.exit(
            f"unknown command '{cmd}': use stubs DIR [--assumed], lock REPORT.json, carried, left-behind, "
            "missing DIR, pack SRC DST or unpack SRC DST"
        )


if __name__ == "__main__":
    main()
