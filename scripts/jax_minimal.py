"""A hand-written pure-JAX Llama train step for ``bench_train.py``: no Flax, no schedule, no sharding; fused QKV and
gate/up matmuls, layers unrolled, causal mask from ``iota``, optax AdamW with clipping. It is the floor of framework
overhead: what XLA's CPU backend does with the bare math, so the benchmark separates jaxshare's own overhead from
the compiler's."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import optax


def _rms(x: jax.Array, scale: jax.Array) -> jax.Array:
  return x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-5) * scale


def _rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
  half = x.shape[-1] // 2
  x1, x2 = x[..., :half], x[..., half:]
  return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1)


class MinimalTrainer:
  """Same shapes, initialisation scale and optimizer settings as the other contestants (Llama flavour only)."""

  def __init__(self, shape: dict, batches: list):
    if shape["flavor"] != "llama":
      raise ValueError(f"jax_minimal implements the llama flavour only, not {shape['flavor']!r}")
    L, D, F, V = shape["layers"], shape["d"], shape["mlp"], shape["vocab"]
    self.shape = shape
    keys = jax.random.split(jax.random.PRNGKey(0), 6)
    normal = lambda k, s: 0.02 * jax.random.normal(k, s)  # noqa: E731
    self.params = {"embed": normal(keys[0], (V, D)), "head": normal(keys[1], (D, V)), "norm": jnp.ones(D),
                   "layers": [{"norm1": jnp.ones(D), "norm2": jnp.ones(D), "qkv": normal(jax.random.fold_in(keys[2], i),
                                                                                         (D, 3 * D)),
                               "o": normal(jax.random.fold_in(keys[3], i), (D, D)),
                               "gate_up": normal(jax.random.fold_in(keys[4], i), (D, 2 * F)),
                               "down": normal(jax.random.fold_in(keys[5], i), (F, D))} for i in range(L)]}
    decay = jax.tree.map(lambda p: p.ndim >= 2, self.params)
    decay["embed"] = False
    self.tx = optax.chain(optax.clip_by_global_norm(1.0),
                          optax.adamw(3e-3, b1=0.9, b2=0.95, weight_decay=0.1, mask=decay))
    self.opt_state = self.tx.init(self.params)
    self.batches = [(jnp.asarray(x), jnp.asarray(y)) for x, y in batches]
    self.i, self.loss = 0, None

  def _forward(self, params, tokens):
    b, t = tokens.shape
    heads = self.shape["heads"]
    dh = self.shape["d"] // heads
    inv_freq = 1.0 / self.shape["theta"] ** (jnp.arange(dh // 2) * 2.0 / dh)
    angles = jnp.arange(t, dtype=jnp.float32)[:, None] * inv_freq
    cos, sin = jnp.cos(angles)[None, :, None], jnp.sin(angles)[None, :, None]
    causal = jnp.arange(t)[:, None] >= jnp.arange(t)[None, :]
    x = params["embed"][tokens]
    for lp in params["layers"]:
      q, k, v = jnp.split((_rms(x, lp["norm1"]) @ lp["qkv"]).reshape(b, t, 3 * heads, dh), 3, axis=2)
      s = jnp.einsum("bthd,bshd->bhts", _rope(q, cos, sin), _rope(k, cos, sin)) * dh ** -0.5
      p = jax.nn.softmax(jnp.where(causal, s, -1e30), axis=-1)
      x = x + jnp.einsum("bhts,bshd->bthd", p, v).reshape(b, t, -1) @ lp["o"]
      gate, up = jnp.split(_rms(x, lp["norm2"]) @ lp["gate_up"], 2, axis=-1)
      x = x + (jax.nn.silu(gate) * up) @ lp["down"]
    return _rms(x, params["norm"]) @ params["head"]

  @functools.partial(jax.jit, static_argnums=0, donate_argnums=(1, 2))
  def _step(self, params, opt_state, tokens, targets):
    def loss_fn(p):
      return optax.softmax_cross_entropy_with_integer_labels(self._forward(p, tokens), targets).mean()
    loss, grads = jax.value_and_grad(loss_fn)(params)
    updates, opt_state = self.tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  def step(self) -> None:
    x, y = self.batches[self.i % len(self.batches)]
    self.params, self.opt_state, self.loss = self._step(self.params, self.opt_state, x, y)
    self.i += 1

  def sync(self) -> None:
    jax.block_until_ready(self.loss)

  @property
  def num_params(self) -> int:
    return sum(p.size for p in jax.tree.leaves(self.params))
