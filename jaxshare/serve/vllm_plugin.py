"""vLLM's plugin entry point for jaxshare's remote-code exports (group ``vllm.general_plugins``, installed by the
``jaxshare[vllm]`` extra): vLLM calls :func:`register` in every process it starts, before it loads a model."""

from __future__ import annotations

ARCHITECTURE = "JaxshareForCausalLM"  # the ``architectures`` entry of an export's config.json
MODEL_CLASS = "jaxshare.serve.vllm_model:JaxshareForCausalLM"


def register() -> None:
  """Register :data:`MODEL_CLASS` for :data:`ARCHITECTURE` with vLLM's ``ModelRegistry`` (lazily, by name: vLLM
  imports the class, and torch with it, only when it loads such a model). Idempotent."""
  from vllm import ModelRegistry

  if ARCHITECTURE not in ModelRegistry.get_supported_archs():
    ModelRegistry.register_model(ARCHITECTURE, MODEL_CLASS)
