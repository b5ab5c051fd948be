"""Hard-negative mining: ``neoembed mine CARD --model MODEL --out DIR`` and :func:`mine_negatives`.

See :mod:`neoembed.mine.miner` for the stages, :mod:`neoembed.mine.search` for the faiss indexes and
:mod:`neoembed.mine.filters` for what is dropped and why.
"""

from neoembed.mine.miner import MineConfig, MineResult, mine_negatives

__all__ = ["MineConfig", "MineResult", "mine_negatives"]
