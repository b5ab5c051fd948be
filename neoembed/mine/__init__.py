"""Hard-negative mining: ``neoembed mine CARD --model MODEL --out DIR`` and :func:`mine_negatives`.
See :mod:`neoembed.mine.miner` for the stages, :mod:`neoembed.mine.search` for the faiss indexes and
:mod:`neoembed.mine.filters` for what is dropped and why. The names below load on first use, so that the
command line's ``--help`` does not import numpy and torch.
"""

__all__ = ["MineConfig", "MineResult", "mine_negatives"]


def __getattr__(name: str):
    if name in __all__:
        from neoembed.mine import miner

        return getattr(miner, name)
    raise AttributeError(f"module 'neoembed.mine' has no attribute {name!r}")
