"""Decoding for tests: prefill and decode left-padded rows, and check them against the forward pass."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxshare.model.cache import init_cache
from jaxshare.plan import plan_of
from support.models import tokens


# Prompt lengths of the two rows: the second is left-padded by 5 slots.
LENGTHS = (11, 6)
NEW = 4


def decode_rows(cfg, graphdef, params, rows):
  """Prefill the left-padded rows, then decode their last NEW tokens one by one; logits ``[B, T, V]`` aligned
  right (the padding's logits dropped by the caller)."""
  width = max(len(r) for r in rows)
  padded = jnp.stack([jnp.pad(r, (width - len(r), 0)) for r in rows])
  cache = init_cache(plan_of(cfg), len(rows), width, start=jnp.array([width - len(r) for r in rows]))
  step = jax.jit(lambda p, t, c: nnx.merge(graphdef, p).decode(t, c))
  logits, cache = step(params, padded[:, :width - NEW], cache)
  out = [logits]
  for t in range(width - NEW, width):
    logits, cache = step(params, padded[:, t:t + 1], cache)
    out.append(logits)
  assert int(cache.index) == width
  return jnp.concatenate(out, axis=1)


def check_rows(cfg, graphdef, params, tol):
  """Row b is the first ``LENGTHS[b]`` tokens of x[b]: by causality the forward of x gives its logits too."""
  x = tokens(2, max(LENGTHS), seed=3)
  got = decode_rows(cfg, graphdef, params, [x[b, :n] for b, n in enumerate(LENGTHS)])
  want = jax.jit(lambda p, x: nnx.merge(graphdef, p)(x))(params, x)
  for b, n in enumerate(LENGTHS):
    np.testing.assert_allclose(np.asarray(got[b, -n:]), np.asarray(want[b, :n]), atol=tol, rtol=tol,
                               err_msg=f"row {b}")
