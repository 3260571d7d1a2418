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
