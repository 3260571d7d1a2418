"""Recomputation that an enclosing ``jax.checkpoint`` policy cannot undo."""

from __future__ import annotations

from typing import Callable

import jax


def recomputed(f: Callable) -> Callable:
  """``f`` (positional array-tree arguments) whose backward pass recomputes it from its arguments and keeps nothing
  else, as ``jax.checkpoint(f)`` does on its own. Nested in a checkpoint with a policy, ``jax.checkpoint(f)`` keeps
  whatever that policy keeps of ``f``'s intermediates (``model.remat=none``'s policy keeps every matmul: a
  probability reuser's ``[B, H, T, S]`` logits); a ``custom_vjp`` hides them from it.

  Integer arguments (segment ids, offsets) get no cotangent.
  """
  @jax.custom_vjp
  def wrapped(*args):
    return f(*args)

  def forward(*args):
    return f(*args), args

  def backward(args, cotangent):
    # not before the cotangent is there: else XLA may schedule the recomputation as early as its arguments allow
    # and keep its result across the backward pass in between (jax.checkpoint's prevent_cse does the same)
    args, cotangent = jax.lax.optimization_barrier((args, cotangent))
    return jax.vjp(f, *args)[1](cotangent)

  wrapped.defvjp(forward, backward)
  return wrapped
