"""What vLLM can serve of a remote-code export: the K/V sharing of each layer as vLLM's attention layer names.

vLLM's ``Attention(..., kv_sharing_target_layer_name=...)`` gives a layer no KV cache of its own: it reads the named
earlier layer's (Gemma3n's shared suffix uses it). With one K/V head count for the model (vLLM's Llama reads one
``num_key_value_heads``) that expresses GQA, MQA, CLA and MLKV; no vLLM attention reuses another layer's probabilities
or logits, adds UniAttn's ``x W_c`` or ties heads across layers, and per-layer head counts are not expressed either,
so those schedules are refused, naming the feature and the first layer that has it. Pure Python on the
exported ``config.json`` (no vLLM import), so the mapping is tested on any machine.
"""

from __future__ import annotations


class VLLMUnsupportedError(ValueError):
  """A schedule vLLM's attention cannot express; names the feature and the layer."""


_REFUSED = (  # (layer_plans key, value that needs it, the feature)
  ("score_reuse", "probs", "probability reuse (Shared Attention, UniAttn)"),
  ("score_reuse", "logits", "logit reuse (LISA, LISA_plus, DS)"),
  ("compensation", True, "UniAttn's linear compensation W_c"),
  ("tied_qkv", True, "head-wise weight tying (DirectShare)"),
)


def kv_sharing_targets(config: dict, layers_prefix: str = "model.layers") -> list[str | None]:
  """Per layer of a remote-code ``config.json``, vLLM's ``kv_sharing_target_layer_name``: None for a layer that
  owns its K/V cache, its producer's attention layer name (``{layers_prefix}.{i}.self_attn.attn``, vLLM's module
  path of the layer list under the model's prefix) for a K/V consumer. One K/V head count, head width and window
  for the model make a consumer's attention match its producer's, which vLLM does not check.

  Raises:
    VLLMUnsupportedError: not a jaxshare remote-code config, or a layer uses a feature vLLM has no attention for.
  """
  plans = config.get("layer_plans")
  if config.get("model_type") != "jaxshare" or not isinstance(plans, list):
    raise VLLMUnsupportedError("not a jaxshare remote-code config.json (model_type 'jaxshare' with layer_plans)")
  for i, plan in enumerate(plans):
    for key, value, feature in _REFUSED:
      if plan.get(key) == value:
        raise VLLMUnsupportedError(f"vLLM cannot serve {feature}: layer_plans[{i}].{key}={value!r}; serve this "
                                   "model with transformers (trust_remote_code=True)")
  heads = [plan["num_kv_heads"] for plan in plans]
  if len(set(heads)) > 1:
    i = next(i for i, h in enumerate(heads) if h != heads[0])
    raise VLLMUnsupportedError(f"vLLM cannot serve per-layer K/V head counts: layer_plans[{i}].num_kv_heads="
                               f"{heads[i]} but layer 0 has {heads[0]}")
  return [None if plan["kv_source"] == i else f"{layers_prefix}.{plan['kv_source']}.self_attn.attn"
          for i, plan in enumerate(plans)]
