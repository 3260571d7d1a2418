"""Flax NNX model: layers, attention (producer/consumer), superblocks, the scanned transformer."""

from jaxshare.model.transformer import Transformer, build_model

__all__ = ["Transformer", "build_model"]
