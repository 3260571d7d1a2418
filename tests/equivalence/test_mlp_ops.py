"""The MLP ops' hand-written backward passes against autodiff of the plain formulas, in float32 and bfloat16, on
shapes the default model does not use (odd widths, a single token, hidden narrower than the model)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxshare.kernels.mlp import gelu_mlp, swiglu


def _plain_swiglu(x, w_gate, w_up, w_down):
  return jnp.einsum("btf,fd->btd", jax.nn.silu(jnp.einsum("btd,df->btf", x, w_gate))
                    * jnp.einsum("btd,df->btf", x, w_up), w_down)


def _plain_gelu(x, w_up, b_up, w_down, b_down):
  return jnp.einsum("btf,fd->btd", jax.nn.gelu(jnp.einsum("btd,df->btf", x, w_up) + b_up, approximate=False),
                    w_down) + b_down


def _args(op, b, t, d, f, dtype):
  keys = jax.random.split(jax.random.PRNGKey(b * t + d), 6)
  # Pre-activations up to |a| ~ 4, negative ones included, so the activations' curvature matters.
  x = (2.0 * jax.random.normal(keys[0], (b, t, d))).astype(dtype)
  w_in = (jax.random.normal(keys[1], (d, f)) / np.sqrt(d)).astype(dtype)
  w_in2 = (jax.random.normal(keys[2], (d, f)) / np.sqrt(d)).astype(dtype)
  w_out = (jax.random.normal(keys[3], (f, d)) / np.sqrt(f)).astype(dtype)
  if op == "swiglu":
    return (x, w_in, w_in2, w_out)
  return (x, w_in, (0.5 * jax.random.normal(keys[4], (f,))).astype(dtype), w_out,
          jax.random.normal(keys[5], (d,)).astype(dtype))


@pytest.mark.parametrize("op", ["swiglu", "gelu"])
@pytest.mark.parametrize("b,t,d,f", [(2, 16, 8, 24), (1, 1, 5, 3), (3, 7, 12, 40)])
@pytest.mark.parametrize("dtype,tol", [(jnp.float32, 1e-5), (jnp.bfloat16, 3e-2)])
def test_mlp_op_matches_autodiff(op, b, t, d, f, dtype, tol):
  fn, plain = (swiglu, _plain_swiglu) if op == "swiglu" else (gelu_mlp, _plain_gelu)
  args = _args(op, b, t, d, f, dtype)
  np.testing.assert_array_equal(np.asarray(fn(*args), np.float32), np.asarray(plain(*args), np.float32))
  w_out = jax.random.normal(jax.random.PRNGKey(7), (b, t, d))

  def loss(g):
    return lambda *a: jnp.sum(g(*a).astype(jnp.float32) * w_out)

  got = jax.grad(loss(fn), argnums=range(len(args)))(*args)
  # The reference runs in float32 so that the bfloat16 case measures the op's error, not autodiff's.
  want = jax.grad(loss(plain), argnums=range(len(args)))(*(a.astype(jnp.float32) for a in args))
  for i, (g, w) in enumerate(zip(got, want)):
    assert g.dtype == dtype, i
    g, w = np.asarray(g, np.float32), np.asarray(w)
    np.testing.assert_allclose(g, w, atol=tol * np.abs(w).max(), err_msg=f"gradient of argument {i}")
