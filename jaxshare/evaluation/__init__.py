"""Evaluation: validation loss, perplexity, bits per byte, efficiency figures and greedy samples."""
