"""upcycle: sparse upcycling of dense T5 and ViT checkpoints into Mixture-of-Experts models."""

__version__ = '0.1.0'
