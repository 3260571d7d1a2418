"""The decode cache: its bytes are the accounting's, exactly; prefill + step-by-step decode reproduces the full
forward's logits for every preset and for composed schedules, scanned and unscanned, fp32 and bf16, left-padded
rows of different lengths, sliding windows; LISA's NF prefill is the original attention."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from conftest import tiny_config
from jaxshare import accounting
from jaxshare.config.catalogue import schedule_matrix
from jaxshare.model.cache import init_cache
from jaxshare.init.shared import copy_shared_weights
from jaxshare.model.params import layer_location
from jaxshare.plan import plan_of
from jaxshare.schedule import compile_schedule
from support.models import randomized, tokens
from support.decode import check_rows

ALL = schedule_matrix("decode")
# The prefill/decode parity skips the variants whose layers take the same roles as another case (placements,
# semantics, the linear aligner: the catalogue's kernels matrix leaves them out too) and the bf16 case
# (test_bf16_decode_...).
PARITY = sorted(set(ALL) - {"cla4", "mlkv_m3_paper", "sa_paper", "lisa_sl", "bf16_lisa_plus"})


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("name", sorted(ALL))
def test_cache_bytes_equal_accounting(name, dtype):
  cfg = tiny_config(*ALL[name], f"model.dtype={dtype}")
  schedule = compile_schedule(cfg.model, cfg.schedule)
  cache = init_cache(plan_of(cfg), batch=3, max_len=40)
  assert {b.dtype for b in jax.tree.leaves(cache.buffers)} == {jnp.dtype(dtype)}
  per_token = accounting.kv_cache_bytes_per_token(cfg.model, schedule, jnp.dtype(dtype).itemsize)
  assert cache.nbytes == per_token * 3 * 40


@pytest.mark.parametrize("name", PARITY)
def test_prefill_and_decode_equal_forward(name):
  cfg = tiny_config(*ALL[name], "attention.impl=xla")
  _, graphdef, params = randomized(cfg)
  check_rows(cfg, graphdef, params, 2e-5)


@pytest.mark.parametrize("name", ["uniattn", "explicit+lisa_plus"])
def test_unscanned_decode_equals_forward(name):
  cfg = tiny_config(*ALL[name], "model.scan_layers=false")
  _, graphdef, params = randomized(cfg)
  check_rows(cfg, graphdef, params, 2e-5)


@pytest.mark.parametrize("name", ["mlkv_m3", "lisa_sl"])
def test_bf16_decode_equals_forward(name):
  """bf16 compute and cache: the cached path rounds like the forward's materialised path; the forward's default
  recompute path rounds differently (float32 features), so the stated tolerance is bf16's: 0.05 on logits of
  order 1."""
  cfg = tiny_config(*ALL[name], "model.dtype=bfloat16")
  _, graphdef, params = randomized(cfg)
  check_rows(cfg, graphdef, params, 5e-2)


def test_window_longer_than_window():
  """A sliding window of 3 over 11 tokens: decoded queries must drop the keys that left the window."""
  cfg = tiny_config("schedule.kind=cla", "model.sliding_window=3")
  _, graphdef, params = randomized(cfg)
  check_rows(cfg, graphdef, params, 2e-5)


def test_nf_prefill_is_the_original_attention():
  """LISA's NF strategy (LISA Sec. 5.1): prefill with the kept W_q/W_k is the dense model's forward, whatever the
  low-rank deltas; decoding then continues with LISA (its K_LR were written during prefill)."""
  lisa_cfg = tiny_config("schedule.kind=lisa", "schedule.lisa.hidden=8", "schedule.lisa.layers=[1,2]",
                         "schedule.lisa.keep_qk=true")
  lisa_schedule, graphdef, params = randomized(lisa_cfg)
  dense_cfg = tiny_config()
  dense_schedule, dense_gd, dense_params = randomized(dense_cfg)
  dense_params = copy_shared_weights(params, lisa_schedule, dense_params, dense_schedule)
  x = tokens(2, 9, seed=4)
  model = nnx.merge(graphdef, params)
  cache = init_cache(plan_of(lisa_cfg), 2, 12)
  nf, nf_cache = model.decode(x, cache, nf=True)
  np.testing.assert_allclose(np.asarray(nf), np.asarray(nnx.merge(dense_gd, dense_params)(x)), atol=2e-5, rtol=2e-5)
  lisa, lisa_cache = model.decode(x, init_cache(plan_of(lisa_cfg), 2, 12))
  assert float(jnp.abs(nf - lisa).max()) > 1e-3  # the two prefills differ: the deltas are not zero
  for layer in (0, 1):  # what layer 1 caches (its K_LR and V) is what decoding reads, and it reads layer 0's input
    s, c, r, i = layer_location(lisa_schedule, layer)
    for name, buf in nf_cache.buffers[s][r].items():
      np.testing.assert_allclose(np.asarray(buf[c, i]), np.asarray(lisa_cache.buffers[s][r][name][c, i]),
                                 atol=1e-6, err_msg=f"layer {layer} {name}")
  assert "k_lr" in nf_cache.buffers[layer_location(lisa_schedule, 1)[0]][layer_location(lisa_schedule, 1)[2]]


def test_nf_needs_kept_weights():
  cfg = tiny_config("schedule.kind=lisa_plus", "schedule.lisa.layers=[1,2]")
  schedule, graphdef, params = randomized(cfg)
  with pytest.raises(ValueError, match="schedule.lisa.keep_qk=true"):
    nnx.merge(graphdef, params).decode(tokens(1, 4), init_cache(plan_of(cfg), 1, 4), nf=True)


def test_init_cache_refuses_bad_sizes():
  cfg = tiny_config()
  with pytest.raises(ValueError, match="max_len=0"):
    init_cache(plan_of(cfg), 1, 0)
  with pytest.raises(ValueError, match=r"start has shape \(3,\), expected \(2,\)"):
    init_cache(plan_of(cfg), 2, 4, start=jnp.zeros(3, jnp.int32))
