"""The whole model with ``attention.impl=pallas_interpret`` (the Pallas kernels in interpret mode) gives the same
loss and gradients as ``xla`` for every schedule preset and for composed schedules; the dispatch picks and refuses
implementations by platform."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from conftest import tiny_config
from jaxshare import parallel
from jaxshare.config import MeshConfig
from jaxshare.config.catalogue import schedule_matrix
from jaxshare.kernels import dispatch, reference, tuning, xla
from support.models import abstract_graphdef, assert_model_equals_xla, kernel_loss_and_grads, randomized, tokens

CASES = schedule_matrix("kernels")


@pytest.mark.parametrize("name", sorted(CASES))
def test_pallas_interpret_equals_xla(name):
  assert_model_equals_xla(name, "pallas_interpret")


def test_dispatch_by_platform():
  ops = dispatch.get_attention("auto")
  q = jnp.ones((1, 8, 2, 4))
  seg = jnp.ones((1, 8), jnp.int32)
  np.testing.assert_array_equal(ops.attention(q, q, q, seg, seg), xla.attention(q, q, q, seg, seg))  # CPU: xla
  np.testing.assert_array_equal(dispatch.get_attention("xla").attention(q, q, q, seg, seg),
                                xla.attention(q, q, q, seg, seg))
  with pytest.raises(ValueError, match="attention.impl=pallas cannot run here: no GPU or TPU"):
    dispatch.get_attention("pallas").attention(q, q, q, seg, seg)
  with pytest.raises(ValueError, match="attention.impl='flash' is invalid: must be one of auto, xla, "):
    dispatch.get_attention("flash")


def test_sharded_kernels_match_single_device_xla():
  """Under a mesh the kernels run per device inside shard_map (batch over data/fsdp, heads over tensor: 2 K/V heads
  split like the 4 query heads) and give single-device xla's loss and gradients."""
  cfg = ["schedule.kind=gqa+sa", "schedule.kv_heads=2"]
  _, graphdef, params = randomized(tiny_config(*cfg, "attention.impl=pallas_interpret"))
  lb, gb = kernel_loss_and_grads(abstract_graphdef(tiny_config(*cfg, "attention.impl=xla")), params, batch=4)
  with jax.set_mesh(parallel.make_mesh(MeshConfig(data=2, fsdp=2, tensor=2))):  # batch 4 over data x fsdp
    la, ga = kernel_loss_and_grads(graphdef, params, batch=4)
    jaxpr = str(jax.make_jaxpr(lambda p, x: nnx.merge(graphdef, p)(x))(params, tokens(b=4, t=21)))
  np.testing.assert_allclose(float(la), float(lb), rtol=1e-5)
  for u, v in zip(jax.tree.leaves(ga), jax.tree.leaves(gb)):
    np.testing.assert_allclose(np.asarray(u), np.asarray(v), atol=1e-5 * max(np.abs(v).max(), 1e-3))
  assert jaxpr.count("shard_map") >= 2, jaxpr  # the flash and the reuse kernels, each in a shard_map


def test_heads_stay_whole_when_kv_heads_do_not_split_alike():
  """tensor=4 with 2 K/V heads: query head h would not find K/V head h // 2 on its device, so the kernels split
  only the batch; the logits equal single-device xla's."""
  cfg = ["schedule.kind=gqa+sa", "schedule.kv_heads=2"]
  _, graphdef, params = randomized(tiny_config(*cfg, "attention.impl=pallas_interpret"))
  _, graphdef_x, _ = randomized(tiny_config(*cfg, "attention.impl=xla"))
  x = tokens(t=16)
  want = nnx.merge(graphdef_x, params)(x)
  with jax.set_mesh(parallel.make_mesh(MeshConfig(data=2, tensor=4))):
    got = jax.jit(lambda p, x: nnx.merge(graphdef, p)(x))(params, x)
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5, rtol=1e-5)


def test_auto_falls_back_to_xla_once_naming_the_reason(monkeypatch, caplog):
  """On an accelerator, a shape the kernels do not support runs in XLA with one warning; ``pallas`` refuses it.
  Queries shorter than the keys: a role that ``auto`` runs with jaxshare's kernels on a TPU (splash attends a
  sequence to itself only)."""
  monkeypatch.setattr(tuning, "platform", lambda: "tpu")
  monkeypatch.setattr(tuning, "VMEM_LIMIT", 1024)  # every shape is then too large for VMEM
  monkeypatch.setattr(dispatch, "_warned", set())
  q = jax.random.normal(jax.random.PRNGKey(0), (1, 8, 2, 4))
  short, seg, lse = q[:, :4], jnp.ones((1, 8), jnp.int32), jnp.zeros((1, 2, 4))
  ops = dispatch.get_attention("auto")
  with caplog.at_level("WARNING"):
    outs = [ops.attention(short, q, q, seg[:, :4], seg) for _ in range(2)]
    reuse = ops.attention_from_lse(short, q, lse, q, seg[:, :4], seg, scale=0.5)
  for out in outs:
    np.testing.assert_array_equal(out, xla.attention(short, q, q, seg[:, :4], seg))
  np.testing.assert_allclose(reuse, reference.attention_from_lse(short, q, lse, q, seg[:, :4], seg, scale=0.5))
  warnings = [r.getMessage() for r in caplog.records if "falling back to xla" in r.getMessage()]
  assert len(warnings) == 1 and "MiB of VMEM > 0 MiB" in warnings[0], warnings
  with pytest.raises(ValueError, match="attention.impl=pallas cannot run here: T=8, S=8"):
    dispatch.get_attention("pallas").attention(q, q, q, seg, seg)
