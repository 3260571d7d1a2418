"""Scan or unroll, written once: applying modules whose parameters are stacked on a leading axis in order, as one
``nnx.scan`` (``model.scan_layers``: compile time independent of their number) or as the same math unrolled; and the
scan whose backward pass makes its parameters' gradient stacks only when it starts (:func:`scan_deferring_gradients`).
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
from flax import nnx


def scan_or_unroll(fn: Callable[..., tuple[Any, Any]], modules: nnx.Module, carry: Any, per_item: Any, *,
                   count: int, scan: bool, consts: tuple = (), defer_gradients: bool = False) -> tuple[Any, Any]:
  """``fn(module_i, carry, per_item[i], *consts) -> (carry, y_i)`` for i = 0 .. count-1.

  Args:
    modules: ``count`` modules made by ``nnx.vmap`` (parameters stacked on a leading axis).
    per_item: a tree with a leading ``count`` axis, passed sliced (None leaves pass through).
    scan: ``nnx.scan`` over the stacked parameters, else a Python loop over slices of them.
    consts: arrays every call reads whole and nothing differentiates (positions, segment ids).
    defer_gradients: with ``scan``, :func:`scan_deferring_gradients` (the same values and gradients).

  Returns:
    The last carry and the ``y_i`` stacked on a leading ``count`` axis.
  """
  if scan and defer_gradients:
    return scan_deferring_gradients(fn, modules, carry, per_item, consts)
  if scan:
    return nnx.scan(lambda m, c, item: fn(m, c, item, *consts), in_axes=(0, nnx.Carry, 0),
                    out_axes=(nnx.Carry, 0))(modules, carry, per_item)
  graphdef, state = nnx.split(modules)
  ys = []
  for i in range(count):
    carry, y = fn(nnx.merge(graphdef, _at(state, i)), carry, _at(per_item, i), *consts)
    ys.append(y)
  return carry, jax.tree.map(lambda *r: jnp.stack(r), *ys)


def scan_deferring_gradients(fn: Callable[..., tuple[Any, Any]], modules: nnx.Module, carry: Any, per_item: Any,
                             consts: tuple = ()) -> tuple[Any, Any]:
  """:func:`scan_or_unroll`'s scan (same arguments, values and gradients) whose backward pass makes the gradient
  stacks of the modules' parameters (and of ``per_item``) only once the cotangent of its last carry exists.

  jax's transpose of a scan writes the gradients of its stacked inputs into stacks of zeros that have no operand, and
  XLA's GPU scheduler, far below its memory limit, places them at the top of the step. A stack of superblocks whose
  backward pass follows another stack's then holds its parameters' gradient stacks (as large as the parameters, in
  their dtype) through the forward pass and every later stack's backward pass. The ~1.2B UniAttn of
  ``llama_1b_h100.yaml`` (8 dense layers, then 2 superblocks of 4) at 2k tokens on a node of 8 H100s held the dense
  layers' (0.3 GiB per GPU) through the LM head's backward pass, its peak: 3.26 GiB, against dense's 3.19.

  Here the backward pass is this function's own: the forward scan runs ``jax.vjp`` of each iteration and stacks the
  residuals it keeps (what the checkpoints' policies inside ``fn`` save; the residuals that are the iteration's own
  inputs — its parameters, carry and item, and ``consts`` — are not stacked again but read from them in the backward
  pass), and a reverse scan applies each iteration's VJP, writing its parameters' gradient into a carried stack whose
  zeros are made from a scalar that leaves an optimisation barrier together with the incoming cotangent.

  What ``fn`` differentiates must be in ``modules``, ``carry`` or ``per_item``; ``consts`` get no gradient. Values it
  closes over would be stacked with the residuals of every iteration that keeps them.
  """
  graphdef, state = nnx.split(modules)

  def step(state_i, c, item, consts):
    return fn(nnx.merge(graphdef, state_i), c, item, *consts)

  layout: dict[str, Any] = {}  # what tracing the forward pass learns: the VJP's tree, which of its leaves are inputs

  @jax.custom_vjp
  def run(state, c, per_item, consts):
    return jax.lax.scan(lambda c, xs: step(xs[0], c, xs[1], consts), c, (state, per_item))

  def forward(state, c, per_item, consts):
    def body(c, xs):
      state_i, item = xs
      (c_next, y), vjp = jax.vjp(lambda s, c, item: step(s, c, item, consts), state_i, c, item)
      leaves, layout["tree"] = jax.tree.flatten(vjp)
      inputs = jax.tree.leaves((state_i, c, item, consts))
      layout["input"] = [next((k for k, a in enumerate(inputs) if a is leaf), None) for leaf in leaves]
      return c_next, (y, c, [leaf for leaf, k in zip(leaves, layout["input"]) if k is None])

    c_last, (ys, cs, residuals) = jax.lax.scan(body, c, (state, per_item))
    return (c_last, ys), (state, per_item, consts, cs, residuals)

  def backward(saved, cotangent):
    state, per_item, consts, cs, residuals = saved
    ct_carry, ct_ys = cotangent
    # the zeros depend on the cotangent, so XLA makes them where this backward pass starts, not at the step's top
    ct_carry, zero = jax.lax.optimization_barrier((ct_carry, jnp.zeros((), jnp.float32)))
    grads = jax.tree.map(lambda a: jnp.broadcast_to(zero.astype(a.dtype), a.shape), state)

    def body(acc, xs):
      ct_c, grads = acc
      i, state_i, item, c, kept, ct_y = xs
      inputs, kept = jax.tree.leaves((state_i, c, item, consts)), iter(kept)
      vjp = jax.tree.unflatten(layout["tree"], [next(kept) if k is None else inputs[k] for k in layout["input"]])
      g_state, ct_c, g_item = vjp((ct_c, ct_y))
      grads = jax.tree.map(lambda g, u: jax.lax.dynamic_update_index_in_dim(g, u.astype(g.dtype), i, 0), grads,
                           g_state)
      return (ct_c, grads), g_item

    count = jax.tree.leaves(state)[0].shape[0]
    (ct_carry, grads), g_items = jax.lax.scan(body, (ct_carry, grads),
                                              (jnp.arange(count), state, per_item, cs, residuals, ct_ys), reverse=True)
    return grads, ct_carry, g_items, None

  run.defvjp(forward, backward)
  return run(state, carry, per_item, tuple(consts))


def _at(tree: Any, i: int) -> Any:
  return jax.tree.map(lambda a: a[i], tree)
