"""Helpers that several test files share: models, decoding, HF checkpoints (imported as ``support.*``)."""
