"""Navigating a model's parameter tree (pure dict, as ``nnx.to_pure_dict`` gives) by layer."""

from __future__ import annotations

from typing import Any

import jax

from jaxshare.schedule import Schedule


def layer_location(schedule: Schedule, layer: int) -> tuple[int, int, int]:
  """``(segment index, superblock index within the segment, position within the superblock)`` of a layer.

  Raises:
    IndexError: no such layer.
  """
  for s_idx, seg in enumerate(schedule.segments):
    if seg.start <= layer < seg.start + seg.count * seg.superblock_size:
      c, j = divmod(layer - seg.start, seg.superblock_size)
      return s_idx, c, j
  raise IndexError(f"layer {layer} is not in the schedule ({len(schedule.layers)} layers)")


def layer_params(params: dict, schedule: Schedule, layer: int) -> dict[str, Any]:
  """The unstacked parameters of one layer (``attn``, ``mlp``, ``norm1``, ...), leaves indexed out of the stack."""
  s_idx, c, j = layer_location(schedule, layer)
  tree = params["segments"][s_idx]["blocks"]["layers"][j]
  return jax.tree.map(lambda a: a[c], tree)


def replace_layer(params: dict, schedule: Schedule, layer: int, new: dict) -> dict:
  """``params`` with one layer's parameters replaced by ``new`` (same keys and shapes), functionally."""
  s_idx, c, j = layer_location(schedule, layer)
  seg = params["segments"][s_idx]
  stacked = seg["blocks"]["layers"][j]
  updated = jax.tree.map(lambda stack, leaf: stack.at[c].set(leaf.astype(stack.dtype)), stacked, new)
  layers = dict(seg["blocks"]["layers"])
  layers[j] = updated
  segments = dict(params["segments"])
  segments[s_idx] = {**seg, "blocks": {**seg["blocks"], "layers": layers}}
  return {**params, "segments": segments}


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
