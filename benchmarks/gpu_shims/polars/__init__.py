"""Stand-in for polars on the GPU machine, installed by benchmarks/gpu_suite.sh only where polars is absent.

mteb imports polars at module level (its benchmark tables, results frames, leaderboard) but evaluating a task,
which is all ``neoembed mteb`` asks of it, never uses it; the real wheel (54 MB) does not fit the 64 MiB the
device machine receives. Every name resolves to a class whose use raises, so a code path that does need polars
fails loudly, naming the missing package, instead of computing with a fake.
"""

from __future__ import annotations

MESSAGE = (
    "polars is not installed here (benchmarks/gpu_shims stands in for it): carry its wheel to use polars.{}"
)


class _Missing(type):
    def __getattr__(cls, attr: str) -> type:
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _Missing(f"{cls.__name__}.{attr}", (), {})

    def __call__(cls, *args, **kwargs):
        raise ModuleNotFoundError(MESSAGE.format(cls.__name__), name="polars")


def __getattr__(name: str) -> type:
    if name.startswith("__"):
        raise AttributeError(name)
    return _Missing(name, (), {})
