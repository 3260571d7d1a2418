"""Attention implementations: the XLA reference and (in later issues) fused kernels, behind one dispatch."""
