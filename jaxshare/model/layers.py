"""Small NNX building blocks with logical-axis metadata: dense projections, norms, embeddings, MLPs.

Parameters are stored in ``param_dtype`` and cast to the compute ``dtype`` at use (mixed precision).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxshare.kernels.mlp import gelu_mlp, swiglu


def param(rngs: nnx.Rngs, shape: tuple[int, ...], logical_axes: tuple[str, ...], std: float | None,
          dtype: jnp.dtype, trainable: bool = True) -> nnx.Param:
  """A parameter drawn from N(0, std²), or zeros when ``std`` is None. ``trainable=False`` marks a parameter the
  optimizer must never update (metadata read by :func:`jaxshare.train.optimizer.frozen_paths`)."""
  value = jnp.zeros(shape, dtype) if std is None else std * jax.random.normal(rngs.params(), shape, dtype)
  return nnx.Param(value, logical_axes=logical_axes, trainable=trainable)


class DenseGeneral(nnx.Module):
  """``y = einsum(spec, x, W) (+ b)``: a projection whose kernel keeps its head structure.

  Args:
    spec: einsum from input and kernel to output, e.g. ``"btd,dhk->bthk"``.
    shape: kernel shape, e.g. ``(D, H, d)``.
    logical_axes: logical names of the kernel dims.
    bias_shape / bias_axes: trailing output dims that get a bias (``None``: no bias).
    trainable: False for weights kept but never trained (see :func:`param`).
  """

  def __init__(self, spec: str, shape: tuple[int, ...], logical_axes: tuple[str, ...], *, std: float,
               bias_shape: tuple[int, ...] | None, bias_axes: tuple[str, ...] = (), dtype=jnp.float32,
               param_dtype=jnp.float32, trainable: bool = True, rngs: nnx.Rngs):
    self.spec, self.dtype = spec, dtype
    self.kernel = param(rngs, shape, logical_axes, std, param_dtype, trainable)
    self.bias = (param(rngs, bias_shape, bias_axes, None, param_dtype, trainable) if bias_shape is not None
                 else None)

  def __call__(self, x: jax.Array) -> jax.Array:
    y = jnp.einsum(self.spec, x.astype(self.dtype), self.kernel[...].astype(self.dtype))
    if self.bias is not None:
      y = y + self.bias[...].astype(self.dtype)
    return y


def cast_to_compute(module: nnx.Module) -> nnx.Module:
  """``module`` with every :class:`DenseGeneral`'s kernel and bias (an :class:`MLP`'s among them) cast to that
  projection's compute ``dtype``, as each casts them at use: the same outputs and gradients (a cast's transpose casts
  the cotangent back), held in the compute dtype's bytes. Other parameters (norms, LISA's aligners) keep theirs.

  Used where parameters are held as a temporary before their use: a run of layers scanned inside a scanned stack
  receives its layers' parameters as one slice of the stack (``[length, ...]``), which the stack's scan otherwise
  materialises in ``param_dtype`` before the run's scan slices it again, and whose gradient stack it builds in
  ``param_dtype`` too (the ~1.2B UniAttn on a node of 8 H100 under ``model.remat=full``: 0.09 GiB less at every
  length, MLKV 4x8 too).
  """
  dtypes = {path: m.dtype for path, m in nnx.iter_modules(module) if isinstance(m, DenseGeneral)}
  graphdef, state = nnx.split(module)

  def cast(path, leaf: jax.Array) -> jax.Array:
    keys = tuple(k.key for k in path if isinstance(k, jax.tree_util.DictKey))
    dtype = dtypes.get(keys[:-1]) if keys[-1] in ("kernel", "bias") else None
    return leaf if dtype is None else leaf.astype(dtype)

  return nnx.merge(graphdef, jax.tree_util.tree_map_with_path(cast, state))


class RMSNorm(nnx.Module):
  """RMSNorm (Llama): ``x / sqrt(mean(x²) + eps) * scale``, computed in float32."""

  def __init__(self, dim: int, eps: float, param_dtype=jnp.float32):
    self.eps = eps
    self.scale = nnx.Param(jnp.ones((dim,), param_dtype), logical_axes=("norm",))

  def __call__(self, x: jax.Array) -> jax.Array:
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
    return (y * self.scale[...].astype(jnp.float32)).astype(x.dtype)


class LayerNorm(nnx.Module):
  """LayerNorm with scale and bias (GPT-NeoX), computed in float32."""

  def __init__(self, dim: int, eps: float, param_dtype=jnp.float32):
    self.eps = eps
    self.scale = nnx.Param(jnp.ones((dim,), param_dtype), logical_axes=("norm",))
    self.bias = nnx.Param(jnp.zeros((dim,), param_dtype), logical_axes=("norm",))

  def __call__(self, x: jax.Array) -> jax.Array:
    x32 = x.astype(jnp.float32)
    mean = jnp.mean(x32, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(x32 - mean), axis=-1, keepdims=True)
    y = (x32 - mean) * jax.lax.rsqrt(var + self.eps)
    return (y * self.scale[...].astype(jnp.float32) + self.bias[...].astype(jnp.float32)).astype(x.dtype)


def make_norm(norm: str, dim: int, eps: float, param_dtype) -> nnx.Module:
  """``norm``: :attr:`~jaxshare.config.Features.norm` (``rmsnorm`` or ``layernorm``)."""
  return RMSNorm(dim, eps, param_dtype) if norm == "rmsnorm" else LayerNorm(dim, eps, param_dtype)


class MLP(nnx.Module):
  """SwiGLU (``down(silu(gate x) * up x)``) or GELU (``down(gelu(up x + b)) + b``) MLP, by ``activation``
  (:attr:`~jaxshare.config.Features.activation`); ``bias``: biases on the up and down projections.

  Shapes: ``x [B,T,D] -> [B,T,D]``; hidden width F. Runs as one op with a hand-written backward pass
  (:mod:`jaxshare.kernels.mlp`); the parameters are the ``gate``/``up``/``down`` projections' kernels and biases.
  """

  def __init__(self, activation: str, d_model: int, hidden: int, *, bias: bool, std: float, out_std: float, dtype,
               param_dtype, rngs: nnx.Rngs):
    self.dtype = dtype
    kw = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
    self.gate = (DenseGeneral("btd,df->btf", (d_model, hidden), ("embed", "mlp"), std=std, bias_shape=None, **kw)
                 if activation == "swiglu" else None)
    self.up = DenseGeneral("btd,df->btf", (d_model, hidden), ("embed", "mlp"), std=std,
                           bias_shape=(hidden,) if bias else None, bias_axes=("mlp",), **kw)
    self.down = DenseGeneral("btf,fd->btd", (hidden, d_model), ("mlp", "embed"), std=out_std,
                             bias_shape=(d_model,) if bias else None, bias_axes=("embed",), **kw)

  def __call__(self, x: jax.Array) -> jax.Array:
    dtype = self.dtype
    if self.gate is not None:
      return swiglu(x.astype(dtype), *(p[...].astype(dtype) for p in (self.gate.kernel, self.up.kernel,
                                                                         self.down.kernel)))
    return gelu_mlp(x.astype(dtype), *(p[...].astype(dtype) for p in (self.up.kernel, self.up.bias,
                                                                        self.down.kernel, self.down.bias)))
