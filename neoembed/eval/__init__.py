"""MTEB evaluation: local or hub data, the paper's instructions, Table-4 summaries, comparisons."""
