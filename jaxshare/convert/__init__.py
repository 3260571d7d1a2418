"""Hugging Face checkpoints in and out: reading HF directories (safetensors only), one mapping table per
architecture, and the uptraining conversions from dense models into sharing schedules."""
