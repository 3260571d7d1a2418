"""Serving an export: the transformers remote code a K/V-sharing export carries (``remote_code/``, copied into it by
:mod:`jaxshare.convert.remote`) and the vLLM plugin that serves such exports with only their producers' K/V cached
(:mod:`~jaxshare.serve.vllm_plugin`, :mod:`~jaxshare.serve.vllm_model`, :mod:`~jaxshare.serve.vllm_layers`)."""

from pathlib import Path

# The remote code's directory: its files are copied into every remote-code export as they are.
REMOTE_CODE_DIR = Path(__file__).resolve().parent / "remote_code"
