"""The unified contrastive trainer (`neoembed train`)."""
