"""Training data: data cards, their loaders, and the multi-dataset batch sampler."""
