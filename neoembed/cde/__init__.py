"""Contextual document embeddings (CDE) on the neoembed backbones: the two-stage model, contextual batching,
false-negative filtering, two-stage GradCache and the trainer."""
