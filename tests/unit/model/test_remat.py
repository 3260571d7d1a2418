"""Rematerialisation (model.remat): every policy computes the same loss and gradients as none; a superblock keeps its
layers' inputs and nothing its layers share; a producer's K/V projections run once in the forward pass and once in
the backward, whatever the number of its readers; host offloading is refused where jax has no pinned host memory."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax._src.ad_checkpoint import saved_residuals

from conftest import tiny_config
from jaxshare import parallel
from jaxshare.config import ConfigError, MeshConfig
from jaxshare.config.catalogue import schedule_matrix
from jaxshare.config.choices import RematPolicy
from jaxshare.model import remat
from jaxshare.train.state import setup_training
from support.models import randomized, tokens

FAMILIES = schedule_matrix("families")
ON_DEVICE = [p.value for p in RematPolicy if p not in remat.OFFLOADED]
B, T = 2, 12


def loss_and_grads(cfg, params):
  _, graphdef, _ = randomized(cfg)
  x = tokens(b=B, t=T)
  return jax.jit(jax.value_and_grad(lambda p: jnp.mean(jax.nn.log_softmax(nnx.merge(graphdef, p)(x))[..., 1])))(params)


def assert_same(a, b, what):
  np.testing.assert_allclose(float(a[0]), float(b[0]), rtol=1e-6, err_msg=what)
  for x, y in zip(jax.tree.leaves(a[1]), jax.tree.leaves(b[1])):
    np.testing.assert_allclose(np.asarray(y), np.asarray(x), atol=1e-6, rtol=1e-5, err_msg=what)


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_full_remat_changes_no_number(name):
  _, _, params = randomized(tiny_config(*FAMILIES[name]))
  assert_same(loss_and_grads(tiny_config(*FAMILIES[name]), params),
              loss_and_grads(tiny_config(*FAMILIES[name], "model.remat=full"), params), f"{name} full")


@pytest.mark.parametrize("policy", [p for p in ON_DEVICE if p not in ("none", "full")])
def test_every_policy_changes_no_number(policy):
  """Each named policy on a superblock with a producer, consumers and probability reusers (CLA + UniAttn)."""
  _, _, params = randomized(tiny_config(*FAMILIES["cla+uniattn"]))
  assert_same(loss_and_grads(tiny_config(*FAMILIES["cla+uniattn"]), params),
              loss_and_grads(tiny_config(*FAMILIES["cla+uniattn"], f"model.remat={policy}"), params), policy)


def _residual_shapes(name, policy):
  cfg = tiny_config(*FAMILIES[name], f"model.remat={policy}")
  _, graphdef, params = randomized(cfg)
  x = tokens(b=B, t=T)
  found = saved_residuals(lambda p: jnp.mean(nnx.merge(graphdef, p)(x)), params)
  return [tuple(aval.shape) for aval, source in found if "argument" not in source]


@pytest.mark.parametrize("name", ["cla", "mlkv", "uniattn"])
def test_a_superblock_keeps_its_input_and_nothing_its_layers_share(name):
  """Under full remat the forward pass keeps each superblock's input ([B, T, D], stacked over the superblocks), as a
  dense model keeps each layer's, and no K/V, queries or probabilities: a producer's K/V and a score source's Q are
  recomputed once for all their readers. save_qkv_proj keeps every layer's input (and its projections) too."""
  d, h = 32, 4
  superblocks = {stack.count for stack in randomized(tiny_config(*FAMILIES[name]))[0].stacks}
  shapes = _residual_shapes(name, "full")
  per_head = [s for s in shapes if len(s) >= 4 and s[-1] == d // h]  # [.., T, heads, head_dim]: K, V or Q
  assert not per_head, f"{name} keeps {per_head} beside its superblocks' inputs"
  inputs = [s for s in shapes if s[-2:] == (T, d)]
  assert inputs and all(s[0] in superblocks for s in inputs if len(s) == 4), inputs
  assert sum(s[0] if len(s) == 4 else 1 for s in inputs) < sum(
    s[0] if len(s) == 4 else 1 for s in _residual_shapes(name, "save_qkv_proj") if s[-2:] == (T, d))


def _kv_projections(name, policy):
  """Executions of K/V projection matmuls ([B, T, D] x [D, G, d] -> [B, T, G, d], G = 2 K/V heads) in the traced
  gradient, scan lengths applied."""
  cfg = tiny_config(*FAMILIES[name], f"model.remat={policy}")
  _, graphdef, params = randomized(cfg)
  x = tokens(b=B, t=T)
  jaxpr = jax.make_jaxpr(jax.grad(lambda p: jnp.mean(nnx.merge(graphdef, p)(x))))(params)

  def count(jaxpr) -> int:
    n = 0
    for eqn in jaxpr.eqns:
      if eqn.primitive.name == "dot_general":
        n += tuple(eqn.outvars[0].aval.shape) == (B, T, 2, 8)
      for sub in jax.extend.core.jaxprs_in_params(eqn.params):
        n += count(sub) * (eqn.params.get("length", 1) if eqn.primitive.name == "scan" else 1)
    return n

  return count(jaxpr.jaxpr)


def test_a_producer_is_projected_once_per_pass_whatever_its_readers():
  """MLKV with 2 producers of 2 K/V heads, each read by 2 layers: 2 K and 2 V projections forward, and under full
  remat as many again in the backward pass (not once more per reader)."""
  assert _kv_projections("mlkv", "none") == 4
  assert _kv_projections("mlkv", "full") == 8


def test_host_offloading_is_refused_on_a_cpu_before_compiling():
  cfg = tiny_config("model.remat=minimal_offloaded")
  with pytest.raises(ConfigError, match="model.remat=minimal_offloaded offloads to pinned host memory.*compiles for "
                                        "cpu. Use model.remat=minimal"):
    setup_training(cfg, parallel.make_mesh(MeshConfig(), jax.devices()[:1]))
