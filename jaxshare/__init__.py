"""jaxshare: JAX/Flax language models whose attention is shared across layers and heads."""

__version__ = "0.1.0"
