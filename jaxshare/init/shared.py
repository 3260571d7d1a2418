"""The rule every conversion starts with: copy each tensor the source and target models share (same layer, name and
shape); what only the target has keeps its fresh values until a more specific rule (:mod:`jaxshare.init`) builds it.
"""

from __future__ import annotations

from typing import Any

import jax

from jaxshare.model.params import layer_params, replace_layer
from jaxshare.schedule import Schedule


def copy_shared_weights(src: dict, src_schedule: Schedule, dst: dict, dst_schedule: Schedule) -> dict:
  """Uptraining initialisation: ``dst`` with every parameter it shares with ``src`` (same layer, same name and
  shape) copied over; parameters only ``dst`` has (LISA's low-rank Q/K and aligner, UniAttn's W_c, ...) keep their
  values. Works on traced arrays.

  Raises:
    ValueError: the two models have different depths.
  """
  if len(src_schedule.layers) != len(dst_schedule.layers):
    raise ValueError(f"cannot copy a {len(src_schedule.layers)}-layer model into a {len(dst_schedule.layers)}-layer one")
  out = dict(dst)
  for key in ("embedding", "final_norm", "lm_head"):
    if key in src and key in dst and jax.tree.structure(src[key]) == jax.tree.structure(dst[key]):
      out[key] = src[key]
  for layer in range(len(dst_schedule.layers)):
    s_layer = layer_params(src, src_schedule, layer)
    d_layer = layer_params(out, dst_schedule, layer)
    merged = _merge_matching(s_layer, d_layer)
    out = replace_layer(out, dst_schedule, layer, merged)
  return out


def _merge_matching(src: Any, dst: Any) -> Any:
  if isinstance(dst, dict):
    return {k: _merge_matching(src.get(k) if isinstance(src, dict) else None, v) for k, v in dst.items()}
  if src is not None and getattr(src, "shape", None) == dst.shape:
    return src
  return dst


def same_shapes(a: Any, b: Any) -> bool:
  """Whether two parameter subtrees have one structure and equal leaf shapes (``a`` may be None: missing)."""
  return a is not None and jax.tree.structure(a) == jax.tree.structure(b) and all(
    x.shape == y.shape for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))
