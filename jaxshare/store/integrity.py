"""Checksums of a checkpoint's arrays, computed on device when it is saved and checked when it is restored.

Orbax and TensorStore check the structure of a checkpoint but not its bytes: a compressed chunk with bytes
overwritten decompresses into other numbers without complaint (found by fault injection: 3 of 3 such checkpoints
loaded, 2 then trained into NaN). Each saved array therefore carries a 64-bit checksum of its bits.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

# Knuth's multiplicative constant: position weights that differ for every index, so that swapped or shifted words
# change the weighted sum.
_GOLDEN = np.uint32(2654435761)


def _word_sums(x: jax.Array) -> jax.Array:
  """``[2] uint32``: the sum of ``x``'s bit patterns and their sum weighted by an odd function of the position,
  both modulo 2**32. Integer sums are associative, so the result does not depend on how ``x`` is sharded or
  reduced. Any one changed word changes the first sum; a random corruption of several goes unseen with probability
  about 2**-64."""
  x = jnp.ravel(x)
  if x.dtype == jnp.bool_:
    x = x.astype(jnp.uint8)
  if x.dtype.itemsize == 8:  # two 32-bit words per element
    x = jax.lax.bitcast_convert_type(x, jnp.uint32).reshape(-1)
  unsigned = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}[x.dtype.itemsize]
  words = jax.lax.bitcast_convert_type(x, unsigned).astype(jnp.uint32)
  weights = jax.lax.iota(jnp.uint32, words.shape[0]) * _GOLDEN | jnp.uint32(1)
  return jnp.stack([jnp.sum(words, dtype=jnp.uint32), jnp.sum(words * weights, dtype=jnp.uint32)])


@jax.jit
def _tree_sums(leaves: list[jax.Array]) -> jax.Array:
  return jnp.stack([_word_sums(x) for x in leaves]) if leaves else jnp.zeros((0, 2), jnp.uint32)


def checksums(tree: Any) -> dict[str, str]:
  """``{key path: 16 hex digits}`` of every array leaf of ``tree`` (``jax.tree_util.keystr`` paths, e.g.
  ``['params']['embed']['embedding']``), computed on the arrays' devices in one jitted pass; works on sharded and
  multi-process global arrays (every process gets the same figures)."""
  paths, leaves = zip(*jax.tree_util.tree_leaves_with_path(tree)) if jax.tree.leaves(tree) else ((), ())
  sums = np.asarray(jax.device_get(_tree_sums(list(leaves))), np.uint64)
  return {jax.tree_util.keystr(p): f"{int(a) << 32 | int(b):016x}" for p, (a, b) in zip(paths, sums)}


def mismatches(tree: Any, expected: dict[str, str]) -> list[str]:
  """Key paths of ``tree``'s leaves whose checksum differs from ``expected`` or is missing from it. Entries of
  ``expected`` that ``tree`` lacks are not reported: a partial restore (the parameters without the optimizer
  state) checks what it read."""
  return [path for path, digest in checksums(tree).items() if expected.get(path) != digest]
