"""Flax NNX model: layers, attention (producer/consumer), superblocks, the scanned transformer."""

from jaxshare.model.transformer import Transformer

__all__ = ["Transformer"]
