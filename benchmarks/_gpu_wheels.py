"""The package lists of benchmarks/gpu_wheels.sh: which wheels the GPU machine needs besides its image.

    python benchmarks/_gpu_wheels.py stubs DIR [--assumed]   # metadata-only wheels standing in for the image's packages
    python benchmarks/_gpu_wheels.py lock REPORT.json        # gpu_wheels.txt from a `pip install --report` of neoembed
    python benchmarks/_gpu_wheels.py carried                 # the pins to download (one per line)
    python benchmarks/_gpu_wheels.py first                   # the names sent in the first device call
    python benchmarks/_gpu_wheels.py missing DIR             # the pins (first call's aside) with no wheel in DIR

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


# polars (mteb imports it; datasets reads retrieval qrels with it) is a 54 MB wheel: with the rest the working tree
# would pass the device's 64 MiB, so it travels alone in a first call (.gpu/polars) that installs it.
FIRST_CALL = ("polars", "polars-runtime-32")


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


def stubs(folder: Path, assumed: bool) -> None:
    """Stub wheels for the image's pinned packages; with ``assumed``, also for the image packages that
    gpu_wheels.txt gives an assumed version (the offline check resolves against exactly these)."""
    folder.mkdir(parents=True, exist_ok=True)
    versions = {n: v for n, v in image_packages().items() if v}
    if assumed:
        versions |= {n: v for n, (v, image) in read_pins(LOCK).items() if image and v and n not in versions}
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
    want = {n: v for n, v in carried().items() if n not in FIRST_CALL}
    problems = [f"{n}=={v}: no wheel in {folder}" for n, v in want.items() if v not in have.get(n, set())]
    problems += [
        f"{n}: {sorted(v)} in {folder}, pinned {want[n]}" for n, v in have.items() if n in want and len(v) > 1
    ]
    if "neoembed" not in have:
        problems.append(f"neoembed: no wheel in {folder} (bash benchmarks/gpu_wheels.sh builds it)")
    return problems


def main() -> None:
    cmd, args = sys.argv[1], sys.argv[2:]
    if cmd == "stubs":
        stubs(Path(args[0]), "--assumed" in args)
    elif cmd == "lock":
        LOCK.write_text(lock(Path(args[0])), encoding="utf8")
        print(LOCK.read_text(encoding="utf8"), end="")
    elif cmd == "carried":
        print("\n".join(f"{n}=={v}" for n, v in carried().items()))
    elif cmd == "missing":
        problems = missing(Path(args[0]))
        print("".join(f"  {p}\n" for p in problems), end="")
        sys.exit(1 if problems else 0)
    elif cmd == "first":
        print("\n".join(FIRST_CALL))
    else:
        sys.exit(
            f"unknown command '{cmd}': use stubs DIR [--assumed], lock REPORT.json, carried, first or missing DIR"
        )


if __name__ == "__main__":
    main()
