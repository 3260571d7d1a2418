"""A probability source's queries and keys whose gradient each reuser sends through the source's projections at once.

A probability reuser (UniAttn Eq. 3, SA Alg. 1) reads its source's rotated Q ``[B, T, H, d]`` and K ``[B, S, G, d]``.
Differentiated as they are, the backward pass of the reusers' run carries the gradients of both from layer to layer
and hands them to the source at the end: two accumulators the size of Q and K, alive across the superblock's backward
pass, which a dense layer never holds (it uses its gradients of Q and K at once). :func:`routed` passes Q and K
through unchanged, and in the backward pass maps their gradient through the source's norm and Q/K projections on the
spot, from the source's input (which the superblock's checkpoint keeps anyway): what the run then carries is the
gradient of the source's input ``[B, T, D]`` and of its few projection parameters. The total gradient is the same
(the source computes Q and K from exactly these arrays); the Q and K handed to the reusers are cut from the graph
(``stop_gradient``) so that no other path carries them. No projection runs twice: their gradient does not read their
output, and XLA drops the forward pass that ``jax.vjp`` traces; what each reuser adds is the norm (elementwise) and
the projections' two gradient matmuls on its own gradient, which the source ran once on the sum.

Measured on the ~1.2B Llama (multi-head, 16 layers, UniAttn superblocks of 4 in the upper half) under
``model.remat=full``, compiled for H100s: 128k tokens on one GPU 39.65 -> 39.21 GiB (dense 39.16), on a node of 8
28.50 -> 28.09 GiB (dense 27.88), for 0.7% more executed FLOPs (3.974e15 -> 4.001e15 at 128k on one GPU: the six
reusers' gradient matmuls, 4.4e12 FLOPs each, and no forward projection).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
from flax import nnx, struct

from jaxshare.kernels.recompute import recomputed


@struct.dataclass
class SourceProjection:
  """What computes a probability source's Q and K: its norm and attention (``graphdef``; ``trained`` the norm's and
  the Q/K projections' parameters, ``rest`` the others) applied to its input ``x [B, T, D]`` at ``positions [B, T]``
  (int32) by :meth:`~jaxshare.model.attention.Attention.source_qk`."""

  graphdef: Any = struct.field(pytree_node=False)
  trained: Any
  rest: Any
  x: jax.Array
  positions: jax.Array

  @classmethod
  def of(cls, norm: nnx.Module, attention: nnx.Module, x: jax.Array, positions: jax.Array) -> SourceProjection:
    """The source layer's ``norm`` (its attention's input norm) and ``attention``, read (not mutated) as arrays."""
    return cls(*split_projections(norm, attention, ("q_proj", "k_proj")), x, positions)

  def route(self, q: jax.Array, k: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``(q, k)`` unchanged; their gradient goes to ``x`` and the ``trained`` parameters (:func:`routed`)."""
    return routed(self.graphdef, self.x, self.trained, self.rest, self.positions, q, k)


def split_projections(norm: nnx.Module, attention: nnx.Module, names: tuple[str, ...]) -> tuple[Any, dict, dict]:
  """``(graphdef, used, rest)`` of a layer's input ``norm`` and ``attention``, as arrays (pure dicts, which a
  ``custom_vjp`` or a scan can read from another trace): ``used`` the norm's parameters and those of the attention's
  projections ``names`` (``"q_proj"``, ...), ``rest`` the attention's others; ``nnx.merge(graphdef, used, rest)``
  gives ``(norm, attention)`` back."""
  graphdef, used, rest = nnx.split((norm, attention), lambda path, _: path[0] == 0 or path[1] in names, ...)
  return graphdef, nnx.to_pure_dict(used), nnx.to_pure_dict(rest)


def recomputed_queries(norm: nnx.Module, attention: nnx.Module, x: jax.Array, positions: jax.Array,
                       head_kernels: dict | None):
  """A score source's :class:`~jaxshare.model.attention.Prepared` queries ``[B, T, H, d]`` from its input ``x [B, T,
  D]`` (``attention.prepare`` with ``source_q``) under :func:`~jaxshare.kernels.recompute.recomputed`, whose backward
  pass recomputes the normalised ``x`` for the projection's gradient instead of keeping it from the forward pass."""
  graphdef, used, rest = split_projections(norm, attention, ("q_proj",))

  def project(x, positions, head_kernels, used, rest):
    norm, attention = nnx.merge(graphdef, used, rest)
    return attention.prepare(norm(x), positions, None, None, 0, head_kernels, source_q=True)

  return recomputed(project)(x, positions, head_kernels, used, jax.lax.stop_gradient(rest))


def _project(graphdef, x, trained, rest, positions) -> tuple[jax.Array, jax.Array]:
  norm, attention = nnx.merge(graphdef, trained, rest)
  return attention.source_qk(norm(x), positions)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def routed(graphdef, x: jax.Array, trained, rest, positions: jax.Array, q: jax.Array,
           k: jax.Array) -> tuple[jax.Array, jax.Array]:
  """``(q, k)``, which the source computed from ``x`` and its parameters; their cotangent goes to ``x`` and
  ``trained`` by the VJP of that computation, none to ``q``, ``k``, ``rest`` or ``positions``."""
  del x, trained, rest, positions
  return q, k


def _routed_fwd(graphdef, x, trained, rest, positions, q, k):
  return (q, k), (x, trained, rest, positions)


def _routed_bwd(graphdef, residuals, cotangent):
  x, trained, rest, positions = residuals
  # recomputed when the reuser's gradient is there, not as early as x allows (see kernels.recompute.recomputed)
  (x, trained, rest), cotangent = jax.lax.optimization_barrier(((x, trained, rest), cotangent))
  _, vjp = jax.vjp(lambda x, trained: _project(graphdef, x, trained, rest, positions), x, trained)
  dx, dtrained = vjp(cotangent)
  return dx, dtrained, None, None, None, None


routed.defvjp(_routed_fwd, _routed_bwd)
