"""Navigating a model's parameter tree (pure dict, as ``nnx.to_pure_dict`` gives) by layer."""

from __future__ import annotations

from typing import Any

import jax

from jaxshare.schedule import Schedule

STACKS = "stacks"  # the stacks' key in the parameter tree (:class:`~jaxshare.model.transformer.Transformer`)


def flat_leaves(tree: dict, prefix: str = "") -> dict[str, Any]:
  """``{"attn/q_proj/kernel": leaf, ...}``: a pure-dict tree's leaves by '/'-joined path (integer keys, as
  ``nnx.List`` levels give, written as digits)."""
  out: dict[str, Any] = {}
  for k, v in tree.items():
    out.update(flat_leaves(v, f"{prefix}{k}/") if isinstance(v, dict) else {f"{prefix}{k}": v})
  return out


def layer_location(schedule: Schedule, layer: int) -> tuple[int, int, int, int]:
  """``(stack, superblock within the stack, run within the superblock, position within the run)`` of a layer.

  Raises:
    IndexError: no such layer.
  """
  for s_idx, stack in enumerate(schedule.stacks):
    if stack.start <= layer < stack.start + stack.count * stack.superblock_size:
      c, j = divmod(layer - stack.start, stack.superblock_size)
      r_idx = next(r for r, run in enumerate(stack.runs) if run.start <= j < run.start + run.length)
      return s_idx, c, r_idx, j - stack.runs[r_idx].start
  raise IndexError(f"layer {layer} is not in the schedule ({len(schedule.layers)} layers)")


def _run_params(params: dict, s_idx: int, r_idx: int) -> dict:
  return params[STACKS][s_idx]["blocks"]["runs"][r_idx]["layers"]


def layer_slot(params: dict, schedule: Schedule, layer: int) -> tuple[dict, tuple[int, int]]:
  """Where a layer lives: its run's stacked parameter dict and the ``(superblock, position)`` index into every leaf
  (for writing a layer in place into NumPy stacks)."""
  s_idx, c, r_idx, i = layer_location(schedule, layer)
  return _run_params(params, s_idx, r_idx), (c, i)


def layer_params(params: dict, schedule: Schedule, layer: int) -> dict[str, Any]:
  """The unstacked parameters of one layer (``attn``, ``mlp``, ``norm1``, ...), leaves indexed out of the stack
  (parameters are stacked ``[superblocks of the stack, layers of the run, ...]``)."""
  s_idx, c, r_idx, i = layer_location(schedule, layer)
  return jax.tree.map(lambda a: a[c, i], _run_params(params, s_idx, r_idx))


def replace_layer(params: dict, schedule: Schedule, layer: int, new: dict) -> dict:
  """``params`` with one layer's parameters replaced by ``new`` (same keys and shapes), functionally."""
  s_idx, c, r_idx, i = layer_location(schedule, layer)
  stacked = _run_params(params, s_idx, r_idx)
  updated = jax.tree.map(lambda stack, leaf: stack.at[c, i].set(leaf.astype(stack.dtype)), stacked, new)
  stack = params[STACKS][s_idx]
  runs = dict(stack["blocks"]["runs"])
  runs[r_idx] = {**runs[r_idx], "layers": updated}
  stacks = dict(params[STACKS])
  stacks[s_idx] = {**stack, "blocks": {**stack["blocks"], "runs": runs}}
  return {**params, STACKS: stacks}
