"""Scan or unroll, written once: applying modules whose parameters are stacked on a leading axis in order, as one
``nnx.scan`` (``model.scan_layers``: compile time independent of their number) or as the same math unrolled."""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
from flax import nnx


def scan_or_unroll(fn: Callable[[nnx.Module, Any, Any], tuple[Any, Any]], modules: nnx.Module, carry: Any,
                   per_item: Any, *, count: int, scan: bool) -> tuple[Any, Any]:
  """``fn(module_i, carry, per_item[i]) -> (carry, y_i)`` for i = 0 .. count-1.

  Args:
    modules: ``count`` modules made by ``nnx.vmap`` (parameters stacked on a leading axis).
    per_item: a tree with a leading ``count`` axis, passed sliced (None leaves pass through).
    scan: ``nnx.scan`` over the stacked parameters, else a Python loop over slices of them.

  Returns:
    The last carry and the ``y_i`` stacked on a leading ``count`` axis.
  """
  if scan:
    return nnx.scan(fn, in_axes=(0, nnx.Carry, 0), out_axes=(nnx.Carry, 0))(modules, carry, per_item)
  graphdef, state = nnx.split(modules)
  ys = []
  for i in range(count):
    at = lambda tree: jax.tree.map(lambda a: a[i], tree)  # noqa: E731
    carry, y = fn(nnx.merge(graphdef, at(state)), carry, at(per_item))
    ys.append(y)
  return carry, jax.tree.map(lambda *r: jnp.stack(r), *ys)
