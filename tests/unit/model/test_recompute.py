"""What model.remat=none keeps (jaxshare.model.remat.keep_all_but_elementwise) and recomputation that an enclosing
policy cannot undo (jaxshare.kernels.recompute.recomputed)."""

import jax
import jax.numpy as jnp
import numpy as np
from jax._src.ad_checkpoint import saved_residuals

from jaxshare.kernels.recompute import recomputed
from jaxshare.model.remat import keep_all_but_elementwise


def _scores(q, k, v):  # [T, d] each: softmax(q kᵀ) v, whose [T, T] logits the backward pass needs
  return jax.nn.softmax(q @ k.T) @ v


def _residual_shapes(f, *args):
  return [aval.shape for aval, _ in saved_residuals(f, *args) if hasattr(aval, "shape")]


def _args(t=16, d=4):
  keys = jax.random.split(jax.random.key(0), 3)
  return [jax.random.normal(key, (t, d)) for key in keys]


def test_recomputed_keeps_nothing_inside_a_policy_that_keeps_every_matmul():
  args = _args()
  outer = lambda inner: jax.checkpoint(  # noqa: E731
    lambda q, k, v: jnp.sum(jnp.sin(inner(q, k, v))), policy=keep_all_but_elementwise)
  # a nested jax.checkpoint is overridden: the outer policy keeps its [T, T] logits
  assert (16, 16) in _residual_shapes(outer(jax.checkpoint(_scores)), *args)
  assert (16, 16) not in _residual_shapes(outer(recomputed(_scores)), *args)
  grads = [jax.grad(outer(inner), argnums=(0, 1, 2))(*args) for inner in (_scores, recomputed(_scores))]
  for a, b in zip(*grads):
    np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)


def test_recomputed_takes_integer_arguments_without_a_cotangent():
  q, k, v = _args()
  offset = jnp.int32(3)
  f = recomputed(lambda q, k, v, offset: _scores(q + offset.astype(q.dtype), k, v))
  g = jax.grad(lambda q: jnp.sum(f(q, k, v, offset)))(q)
  np.testing.assert_allclose(g, jax.grad(lambda q: jnp.sum(_scores(q + 3.0, k, v)))(q), rtol=1e-6, atol=1e-6)


def test_recomputed_waits_for_the_cotangent_before_recomputing():
  """The backward pass recomputes from its arguments as released with the cotangent by one optimisation barrier, as
  jax.checkpoint's prevent_cse does: else XLA may recompute as early as the arguments allow and keep the result
  across the backward pass in between (a UniAttn source's normalised input across its reusers' backward pass)."""
  args = _args()
  jaxpr = jax.make_jaxpr(jax.grad(lambda q, k, v: jnp.sum(jnp.sin(recomputed(_scores)(q, k, v)))))(*args).jaxpr
  barriers = [eqn for eqn in jaxpr.eqns if eqn.primitive.name == "optimization_barrier"]
  assert len(barriers) == 1 and len(barriers[0].invars) == 4  # q, k, v and the cotangent
  after = jaxpr.eqns[jaxpr.eqns.index(barriers[0]) + 1:]
  recomputed_logits = next(eqn for eqn in after if eqn.primitive.name == "dot_general")
  assert recomputed_logits.outvars[0].aval.shape == (16, 16)
  assert set(recomputed_logits.invars) & set(barriers[0].outvars)  # q as released


def test_the_none_policy_recomputes_casts_and_keeps_matmuls():
  x, _, _ = _args()
  w = jax.random.normal(jax.random.key(1), (4, 4))

  def layer(x, w):  # a bfloat16 layer whose norm runs in float32, as the model's do
    h = x.astype(jnp.bfloat16) @ w.astype(jnp.bfloat16)
    h32 = h.astype(jnp.float32)
    return jnp.sum(jnp.tanh(h32 * jax.lax.rsqrt(jnp.mean(h32 * h32, -1, keepdims=True))))

  kept = saved_residuals(jax.checkpoint(layer, policy=keep_all_but_elementwise), x, w)
  dtypes = [aval.dtype for aval, source in kept if "argument" not in source and aval.shape == (16, 4)]
  assert dtypes and all(d == jnp.bfloat16 for d in dtypes), kept  # the matmul's output, no float32 cast of it
  assert any(aval.dtype == jnp.float32 and aval.shape == (16, 4) for aval, _ in saved_residuals(layer, x, w))
