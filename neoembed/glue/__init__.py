"""GLUE fine-tuning with the NeoBERT paper's protocol (``neoembed glue``): tasks and metrics, one run, the grid."""
