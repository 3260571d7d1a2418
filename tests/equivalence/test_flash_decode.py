"""The Pallas decode kernel (interpret mode) against XLA: the cache alone over several key splits (MHA, GQA, MQA;
rows whose valid slots miss whole splits, and a row with none; bf16; head widths that are not powers of two), the cache-and-new-rows merge against one softmax over both blocks, and a model decoding
with ``attention.impl=pallas_interpret`` against the XLA decode.

Tolerances: float32, 2e-5 (a different summation order); bfloat16, 2e-2 on outputs of order 1 (P rounded to
bfloat16 before the V matmul in both, per split in the kernel).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from conftest import tiny_config
from jaxshare.config.catalogue import schedule_matrix
from jaxshare import parallel
from jaxshare.config import MeshConfig
from jaxshare.kernels import decode, flash_decode
from jaxshare.kernels.dispatch import get_attention
from jaxshare.kernels.reference import masked_softmax
from jaxshare.model.cache import init_cache
from jaxshare.plan import plan_of
from support.decode import check_rows
from support.models import randomized, tokens

ALL = schedule_matrix("decode")

S = 64


def _inputs(b, n, h, g, e, d, dtype, seed=0):
  k1, k2, k3, k4, k5, k6 = jax.random.split(jax.random.key(seed), 6)
  q = jax.random.normal(k1, (b, n, h, e)).astype(dtype)
  cache = (jax.random.normal(k2, (b, g, S, e)).astype(dtype), jax.random.normal(k3, (b, g, S, d)).astype(dtype))
  new = (jax.random.normal(k4, (b, g, n, e)).astype(dtype), jax.random.normal(k5, (b, g, n, d)).astype(dtype))
  return q, cache, new


def _cache_mask(b, n, index):
  """Rows start at slots 0, 20 and 37 (the last misses the first two 16-slot splits) and the cache holds ``index``
  slots; row 3 starts after the index: it reads no cached slot."""
  starts = np.array([0, 20, 37, index + 1, 5][:b])
  slots = np.arange(S)
  mask = (slots[None] >= starts[:, None]) & (slots[None] < index)
  return jnp.asarray(np.broadcast_to(mask[:, None], (b, n, S)))


@pytest.mark.parametrize("h,g,e,d", [(4, 4, 16, 16), (4, 2, 16, 8), (6, 1, 12, 20), (8, 2, 32, 32)])
def test_cache_attention_equals_softmax_over_the_cache(h, g, e, d):
  q, (k, v), _ = _inputs(4, 1, h, g, e, d, jnp.float32)
  mask = _cache_mask(4, 1, index=50)
  out, lse = flash_decode.cache_attention(q, k, v, mask, scale=0.3, block_k=16)
  logits = decode.scores(q, (k,), 0.3)
  probs, want_lse = masked_softmax(logits, mask)
  want = decode.apply_probs(probs, (v,), jnp.float32)
  np.testing.assert_allclose(np.asarray(out[:3]), np.asarray(want[:3]), atol=2e-5, rtol=2e-5)
  np.testing.assert_allclose(np.asarray(lse[:3]), np.asarray(want_lse[:3]), atol=2e-5, rtol=2e-5)
  assert np.all(np.asarray(out[3]) == 0) and np.all(np.isneginf(np.asarray(lse[3])))  # nothing cached to read


@pytest.mark.parametrize("dtype,tol", [("float32", 2e-5), ("bfloat16", 2e-2)])
def test_split_attention_equals_one_softmax_over_both_blocks(dtype, tol):
  q, cache, new = _inputs(4, 1, 4, 2, 16, 16, jnp.dtype(dtype))
  mask = jnp.concatenate([_cache_mask(4, 1, index=50), jnp.ones((4, 1, 1), bool)], -1)
  k, v = (cache[0], new[0]), (cache[1], new[1])
  got = decode.split_attention(q, k, v, mask, scale=0.25, dtype=jnp.float32, block_k=16)
  want = decode.attention(q, k, v, mask, scale=0.25, dtype=jnp.float32)
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=tol, rtol=tol)


def test_block_size_and_refusals():
  assert [flash_decode.block_size(s) for s in (1024, 384, 200, 4096 + 64)] == [512, 128, 200, None]
  k = jax.ShapeDtypeStruct((1, 1, 4096 + 64, 16), jnp.float32)
  assert "cache length 4160" in flash_decode.unsupported(jax.ShapeDtypeStruct((1, 1, 2, 16), jnp.float32), k, k,
                                                         backend="mosaic_tpu")
  q = jax.ShapeDtypeStruct((1, 1, 2, 24), jnp.float32)
  kv = jax.ShapeDtypeStruct((1, 1, 256, 24), jnp.float32)
  assert "powers of two" in flash_decode.unsupported(q, kv, kv, backend="triton")
  assert flash_decode.unsupported(q, kv, kv, backend="mosaic_tpu") is None
  q, (k, v), _ = _inputs(1, 1, 2, 1, 16, 16, jnp.float32)
  with pytest.raises(ValueError, match="key block 24 must divide the cache length 64"):
    flash_decode.cache_attention(q, k, v, jnp.ones((1, 1, S), bool), scale=1.0, block_k=24)
  with pytest.raises(ValueError, match="2 new tokens per row; the decode kernel takes one"):
    flash_decode.cache_attention(jnp.concatenate([q, q], 1), k, v, jnp.ones((1, 2, S), bool), scale=1.0)


def test_pallas_is_refused_without_an_accelerator():
  q, cache, new = _inputs(1, 1, 2, 1, 16, 16, jnp.float32)
  with pytest.raises(ValueError, match="attention.impl=pallas cannot run here: no GPU or TPU"):
    get_attention("pallas").decode_attention(q, (cache[0], new[0]), (cache[1], new[1]),
                                             jnp.ones((1, 1, S + 1), bool), scale=1.0, dtype=jnp.float32)


def test_model_decodes_with_the_kernel():
  """Own-score layers that hand nothing on (MLKV's producers and K/V consumers) decode through the kernel: prefill
  and step-by-step decode equal the forward, and a decode step through the kernel equals the XLA path."""
  name = "mlkv_m3"
  cfg = tiny_config(*ALL[name], "attention.impl=pallas_interpret")
  schedule, graphdef, params = randomized(cfg)
  check_rows(cfg, graphdef, params, 2e-5)
  xla_cfg = tiny_config(*ALL[name], "attention.impl=xla")
  xla_graphdef = randomized(xla_cfg)[1]
  x = tokens(2, 5, seed=1)

  def last_step(graphdef):
    model = nnx.merge(graphdef, params)
    _, cache = model.decode(x[:, :4], init_cache(plan_of(cfg), 2, 8))
    return model.decode(x[:, 4:], cache)[0]

  got, want = last_step(graphdef), last_step(xla_graphdef)
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("impl", ["xla", "pallas_interpret"])
def test_sharded_decode_equals_single_device(impl):
  """Under a data 2 × fsdp 2 × tensor 2 mesh the cache is sharded like the activations (batch over data × fsdp, the
  2 K/V heads over tensor) and stays so through prefill and decode steps; the logits equal one device's (the
  kernel runs per device in shard_map)."""
  cfg = tiny_config("schedule.kind=mlkv", "schedule.kv_layers=2", "schedule.kv_heads=2", f"attention.impl={impl}")
  schedule, graphdef, params = randomized(cfg)
  x = tokens(4, 7, seed=2)

  def run():
    step = jax.jit(lambda p, t, c: nnx.merge(graphdef, p).decode(t, c), donate_argnums=2)
    cache = init_cache(plan_of(cfg), 4, 8, start=jnp.asarray([0, 2, 0, 3], jnp.int32))
    logits, cache = step(params, x[:, :4], cache)
    out = [logits]
    for t in range(4, 7):
      logits, cache = step(params, x[:, t:t + 1], cache)
      out.append(logits)
    return jnp.concatenate(out, 1), cache

  want, _ = run()
  mesh = parallel.make_mesh(MeshConfig(data=2, fsdp=2, tensor=2))
  with jax.set_mesh(mesh):
    params = jax.device_put(params, parallel.param_shardings(nnx.state(nnx.merge(graphdef, params)), mesh))
    got, cache = run()
    if impl == "pallas_interpret":  # the kernel ran per device
      assert "shard_map" in str(jax.make_jaxpr(lambda p, t, c: nnx.merge(graphdef, p).decode(t, c))(
        params, x[:, :1], cache))
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5, rtol=2e-5)
  for buf in jax.tree.leaves(cache.buffers):  # [count, length, B, G, S, e]
    assert buf.sharding.spec[2:4] == (("data", "fsdp"), "tensor"), buf.sharding
    assert buf.addressable_shards[0].data.shape[2:4] == (1, 1)
