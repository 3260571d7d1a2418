"""Context parallelism's sequence layout: the sequence split over the mesh's ``context`` axis (MaxText's
``ici_context_parallelism``).

Each of the ``c`` devices of a context group holds ``T / c`` tokens of every sequence and all of their activations;
attention, the only operation that mixes tokens, attends each device's queries to the whole sequence's keys
(:mod:`jaxshare.kernels.local_queries`).

**Load-balanced layout** (MaxText's ``context_parallel_load_balance``). Causal attention gives a late query more keys
than an early one, so contiguous shards would leave the first device idle while the last works. The sequence is cut
into ``2c`` chunks of ``C = T / 2c`` tokens and device ``i`` holds chunks ``i`` and ``2c - 1 - i``
(:func:`layout`): every device then attends ``(2c + 1) C`` keys per query row of its chunk pair, the same work. The
model permutes its inputs into this layout on entry and its residual stream back before the LM head
(:func:`to_layout`, :func:`from_layout`), so its callers see the sequence in order.

**Keys gathered once per producer.** A layer that projects K/V (or a LISA layer its low-rank keys) all-gathers them
over the context axis and restores the natural order (:func:`gather_keys`, an XLA all-gather; its transpose in the
backward pass a reduce-scatter). Every layer that reads them — the producer itself, its K/V consumers, probability
reusers of its scores — receives the gathered keys and issues no collective of its own: with CLA2 half of dense's
layers gather, with MLKV only its producers.
"""


from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxshare import parallel

AXIS = "context"


def size() -> int:
  """The context axis size of the ambient mesh (1 without a mesh or a context axis)."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty or AXIS not in mesh.axis_names:
    return 1
  return mesh.shape[AXIS]


def active() -> bool:
  """Whether the model being traced runs context parallel (:func:`size` > 1)."""
  return size() > 1


@functools.cache
def layout(length: int, shards: int) -> np.ndarray:
  """The load-balanced layout of ``length`` tokens over ``shards`` devices: position ``p`` of the layout holds token
  ``layout[p]`` (int32 ``[length]``); device ``i`` holds positions ``[i T/c, (i+1) T/c)``, chunks ``i`` and
  ``2c - 1 - i`` of ``T / 2c`` tokens.

  Raises:
    ValueError: ``length`` is not a multiple of ``2 * shards``.
  """
  if length % (2 * shards):
    raise ValueError(f"context parallelism over {shards} devices needs a sequence of a multiple of {2 * shards} "
                     f"tokens, not {length}")
  chunk = length // (2 * shards)
  order = [n for i in range(shards) for n in (i, 2 * shards - 1 - i)]
  return np.concatenate([np.arange(n * chunk, (n + 1) * chunk) for n in order]).astype(np.int32)


def _permute(x: jax.Array, axis: int, inverse: bool) -> jax.Array:
  c = size()
  if c == 1:
    return x
  order = layout(x.shape[axis], c)
  return jnp.take(x, np.argsort(order) if inverse else order, axis=axis)


def to_layout(x: jax.Array, axis: int = 1) -> jax.Array:
  """``x`` with its sequence ``axis`` in order permuted into the load-balanced :func:`layout` (identity without a
  context axis)."""
  return _permute(x, axis, inverse=False)


def from_layout(x: jax.Array, axis: int = 1) -> jax.Array:
  """Inverse of :func:`to_layout`."""
  return _permute(x, axis, inverse=True)


def in_order(x: jax.Array, axis: int, shards: int) -> jax.Array:
  """A whole sequence held in the :func:`layout` of ``shards`` devices, put in order by slicing its ``2 shards``
  chunks and joining them (a local copy: inside a ``shard_map``, of keys every device holds whole)."""
  chunk = x.shape[axis] // (2 * shards)
  place = lambda n: 2 * n if n < shards else 2 * (2 * shards - 1 - n) + 1  # noqa: E731  chunk n's layout slot
  return jnp.concatenate([jax.lax.slice_in_dim(x, place(n) * chunk, (place(n) + 1) * chunk, axis=axis)
                          for n in range(2 * shards)], axis=axis)


_REPLICATED_LENGTH = {2: ("activation_batch", None)}
GATHERED = ("activation_gathered_batch", None, "activation_kv_heads", None)  # logical axes of gathered keys


def gather_keys(x: jax.Array) -> jax.Array:
  """Keys (or values) of the whole sequence on every device of the context axis: ``x`` (``[B, T, G, e]`` in the
  :func:`layout`, sequence sharded over the context axis) all-gathered, still in the layout, as ``c`` copies stacked
  on the batch dimension (``[c B, T, G, e]``, copy ``r`` on the devices of context index ``r``: logical axes
  :data:`GATHERED`). Identity without a context axis.

  Why copies: every layer that reads the keys adds its gradient to the copy of its own device, and the one sum over
  the context axis (the transpose of the copies) comes after all of them, as one reduce-scatter. Keys merely
  replicated over the axis would make each reader's attention sum its gradient across the axis on its own: with CLA2
  two full all-reduces per producer, as much as dense's. The attention kernels put the keys in order locally
  (:func:`in_order`). Named ``kv_gather`` in the compiled program, so that the fit check counts its bytes as K/V
  traffic."""
  c = size()
  if c == 1:
    return x
  with jax.named_scope("kv_gather"):
    return parallel.constrain(jnp.tile(x, (c,) + (1,) * (x.ndim - 1)), GATHERED[:x.ndim])


def whole_sequence(x: jax.Array) -> jax.Array:
  """``x`` (``[B, T]``, in order) on every device of the context axis (the model's document ids, which the attention
  kernels read in order beside the gathered keys). Identity without a context axis."""
  if not active():
    return x
  return parallel.constrain(x, _REPLICATED_LENGTH[x.ndim])
