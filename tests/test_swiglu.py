"""The SwiGLU op's hand-written backward against autodiff of the plain formula, in float32 and bfloat16, on shapes
the default model does not use (odd widths, a single token, hidden narrower than the model)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxshare.kernels.swiglu import swiglu


def _plain(x, w_gate, w_up, w_down):
  return jnp.einsum("btf,fd->btd", jax.nn.silu(jnp.einsum("btd,df->btf", x, w_gate))
                    * jnp.einsum("btd,df->btf", x, w_up), w_down)


@pytest.mark.parametrize("b,t,d,f", [(2, 16, 8, 24), (1, 1, 5, 3), (3, 7, 12, 40)])
@pytest.mark.parametrize("dtype,tol", [(jnp.float32, 1e-5), (jnp.bfloat16, 3e-2)])
def test_swiglu_matches_autodiff(b, t, d, f, dtype, tol):
  keys = jax.random.split(jax.random.PRNGKey(b * t + d), 5)
  # Large enough pre-activations that SiLU's curvature matters (|g| up to ~4), negative ones included.
  x = (2.0 * jax.random.normal(keys[0], (b, t, d))).astype(dtype)
  w_gate, w_up = ((jax.random.normal(k, (d, f)) / np.sqrt(d)).astype(dtype) for k in keys[1:3])
  w_down = (jax.random.normal(keys[3], (f, d)) / np.sqrt(f)).astype(dtype)
  w_out = jax.random.normal(keys[4], (b, t, d))
  np.testing.assert_array_equal(np.asarray(swiglu(x, w_gate, w_up, w_down), np.float32),
                                np.asarray(_plain(x, w_gate, w_up, w_down), np.float32))

  def loss(fn):
    return lambda *a: jnp.sum(fn(*a).astype(jnp.float32) * w_out)

  args = (x, w_gate, w_up, w_down)
  got = jax.grad(loss(swiglu), argnums=range(4))(*args)
  # The reference runs in float32 so that the bfloat16 case measures the op's error, not autodiff's.
  want = jax.grad(loss(_plain), argnums=range(4))(*(a.astype(jnp.float32) for a in args))
  for name, g, w in zip(("x", "w_gate", "w_up", "w_down"), got, want):
    assert g.dtype == dtype, name
    g, w = np.asarray(g, np.float32), np.asarray(w)
    np.testing.assert_allclose(g, w, atol=tol * np.abs(w).max(), err_msg=f"d{name}")
