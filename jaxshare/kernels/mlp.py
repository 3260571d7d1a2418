"""The two MLPs (SwiGLU, Llama; GELU, GPT-NeoX) as ops with hand-written backward passes.

Autodiff of the einsums and the activation leaves XLA's CPU backend a backward pass in which the SiLU derivative
is fused into loops that write the ``[F, B·T]`` transposes the weight-gradient matmuls ask for, several passes over
the hidden activations, each strided (≈10 ms per layer at the default shape, issue 7). Here the backward is
written out once, in the order the matmuls want their operands::

  s = silu(g) = g·σ(g),  h = s·u,  y = h W_down
  dh = dy W_downᵀ,  du = dh·s,  dg = dh·u·σ(g)·(1 + g·(1 − σ(g)))
  dW_down = hᵀ dy,  dW_up = xᵀ du,  dW_gate = xᵀ dg,  dx = dg W_gateᵀ + du W_upᵀ

and for GELU (``a = x W_up + b_up``, ``h = gelu(a) = a·Φ(a)``, ``y = h W_down + b_down``)::

  da = (dy W_downᵀ)·(Φ(a) + a·φ(a)),  dW_down = hᵀ dy,  dW_up = xᵀ da,  dx = da W_upᵀ,  db = Σ_tokens

Each saves its input and pre-activations (what autodiff saves too) and recomputes the activation elementwise. The
elementwise backward runs in float32 whatever the compute dtype; gradients equal autodiff's to float32 rounding.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxshare import parallel

_HIDDEN = ("activation_batch", "activation_length", "activation_mlp")


@jax.custom_vjp
def swiglu(x: jax.Array, w_gate: jax.Array, w_up: jax.Array, w_down: jax.Array) -> jax.Array:
  """SwiGLU MLP (Shazeer 2020, Eq. 6 without biases, as in Llama).

  Args:
    x: ``[B, T, D]`` input in the compute dtype.
    w_gate, w_up: ``[D, F]``; w_down: ``[F, D]``, all in the compute dtype.

  Returns:
    ``[B, T, D]`` in the compute dtype.
  """
  return _forward(x, w_gate, w_up, w_down)[0]


def _forward(x, w_gate, w_up, w_down):
  g = jnp.einsum("btd,df->btf", x, w_gate)
  u = jnp.einsum("btd,df->btf", x, w_up)
  h = parallel.constrain(jax.nn.silu(g) * u, _HIDDEN)
  return jnp.einsum("btf,fd->btd", h, w_down), (x, g, u, w_gate, w_up, w_down)


def _backward(res, d_y):
  x, g, u, w_gate, w_up, w_down = res
  dtype = x.dtype
  g32, u32 = g.astype(jnp.float32), u.astype(jnp.float32)
  sig = jax.nn.sigmoid(g32)
  s = g32 * sig
  h = parallel.constrain((s * u32).astype(dtype), _HIDDEN)
  d_h = jnp.einsum("btd,fd->btf", d_y, w_down, preferred_element_type=jnp.float32)
  d_u = parallel.constrain((d_h * s).astype(dtype), _HIDDEN)
  d_g = parallel.constrain((d_h * u32 * sig * (1.0 + g32 * (1.0 - sig))).astype(dtype), _HIDDEN)
  d_w_down = jnp.einsum("btf,btd->fd", h, d_y)
  d_w_up = jnp.einsum("btd,btf->df", x, d_u)
  d_w_gate = jnp.einsum("btd,btf->df", x, d_g)
  d_x = jnp.einsum("btf,df->btd", d_g, w_gate) + jnp.einsum("btf,df->btd", d_u, w_up)
  return d_x, d_w_gate, d_w_up, d_w_down


swiglu.defvjp(_forward, _backward)


@jax.custom_vjp
def gelu_mlp(x: jax.Array, w_up: jax.Array, b_up: jax.Array, w_down: jax.Array, b_down: jax.Array) -> jax.Array:
  """GPT-NeoX MLP ``gelu(x W_up + b_up) W_down + b_down`` with the exact (erf) GELU (Hendrycks & Gimpel 2016).

  Args:
    x: ``[B, T, D]``; w_up ``[D, F]``, b_up ``[F]``, w_down ``[F, D]``, b_down ``[D]``; all in the compute dtype.

  Returns:
    ``[B, T, D]`` in the compute dtype.
  """
  return _gelu_forward(x, w_up, b_up, w_down, b_down)[0]


def _gelu_forward(x, w_up, b_up, w_down, b_down):
  a = jnp.einsum("btd,df->btf", x, w_up) + b_up
  h = parallel.constrain(jax.nn.gelu(a, approximate=False), _HIDDEN)
  return jnp.einsum("btf,fd->btd", h, w_down) + b_down, (x, a, w_up, w_down)


def _gelu_backward(res, d_y):
  x, a, w_up, w_down = res
  dtype = x.dtype
  a32 = a.astype(jnp.float32)
  cdf = 0.5 * (1.0 + jax.lax.erf(a32 * 0.5 ** 0.5))
  pdf = jnp.exp(-0.5 * a32 * a32) * (2.0 * jnp.pi) ** -0.5
  h = parallel.constrain(jax.nn.gelu(a, approximate=False), _HIDDEN)
  d_h = jnp.einsum("btd,fd->btf", d_y, w_down, preferred_element_type=jnp.float32)
  d_a = parallel.constrain((d_h * (cdf + a32 * pdf)).astype(dtype), _HIDDEN)
  d_w_down = jnp.einsum("btf,btd->fd", h, d_y)
  d_w_up = jnp.einsum("btd,btf->df", x, d_a)
  d_b_up = jnp.sum(d_a, (0, 1), dtype=jnp.float32).astype(dtype)
  d_b_down = jnp.sum(d_y, (0, 1), dtype=jnp.float32).astype(dtype)
  return jnp.einsum("btf,df->btd", d_a, w_up), d_w_up, d_b_up, d_w_down, d_b_down


gelu_mlp.defvjp(_gelu_forward, _gelu_backward)
