"""Rematerialisation (model.remat): every policy computes the same loss and gradients as none; a superblock keeps its
layers' inputs and nothing its layers share; a producer's K/V projections run once in the forward pass and once in
the backward, whatever the number of its readers; a run scanned inside a scanned stack holds its kernels in the compute
dtype; host offloading is refused where jax has no pinned host memory."""

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
from jaxshare.model.layers import cast_to_compute
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


def _nested_scan_kernels(jaxpr, depth=0) -> list:
  """The dtypes of the matrices (rank >= 3: ``[length, in, ...out]``) a scan inside a scan slices per layer."""
  found = []
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "scan" and depth:
      xs = eqn.invars[eqn.params["num_consts"] + eqn.params["num_carry"]:]
      found += [v.aval.dtype for v in xs if v.aval.ndim >= 3 and jnp.issubdtype(v.aval.dtype, jnp.floating)]
    for sub in jax.extend.core.jaxprs_in_params(eqn.params):
      found += _nested_scan_kernels(sub, depth + (eqn.primitive.name == "scan"))
  return found


# superblocks with a run of several layers: a producer and 3 consumers, a score source and 2 reusers
LONG_RUNS = {"mlkv": [*FAMILIES["mlkv"], "model.num_layers=8"],
             "uniattn": [*FAMILIES["uniattn"], "model.num_layers=8", "schedule.uniattn.block_size=3"]}


@pytest.mark.parametrize("name", sorted(LONG_RUNS))
def test_a_run_scanned_in_a_scanned_stack_slices_kernels_in_the_compute_dtype(name):
  """Under a policy a superblock's run of several layers is a scan inside the stack's: its layers' kernels reach it
  as one slice of the stack's parameters, which it holds (and whose gradients it stacks) in the compute dtype, not in
  float32 (cast_to_compute)."""
  cfg = tiny_config(*LONG_RUNS[name], "model.remat=full", "model.dtype=bfloat16")
  _, graphdef, params = randomized(cfg)
  jaxpr = jax.make_jaxpr(jax.grad(lambda p: jnp.mean(nnx.merge(graphdef, p)(tokens(b=B, t=T)))))(params)
  kernels = _nested_scan_kernels(jaxpr.jaxpr)
  assert kernels and all(d == jnp.bfloat16 for d in kernels), kernels


def test_cast_to_compute_changes_no_number():
  """The cast view of a bfloat16 layer stack gives its outputs and float32 gradients bit for bit; its kernels are
  bfloat16, its norms' scales stay float32."""
  cfg = tiny_config(*LONG_RUNS["uniattn"], "model.dtype=bfloat16")
  model = nnx.merge(*randomized(cfg)[1:])
  layers = next(run.layers for stack in model.stacks for run in stack.blocks.runs if run.length > 1)  # reusers
  graphdef, state = nnx.split(layers)
  x = jax.random.normal(jax.random.key(0), (B, T, 32), jnp.bfloat16)

  def first(run):  # the first layer of the first superblock: the stack's and the run's axes sliced
    g, s = nnx.split(run)
    return nnx.merge(g, jax.tree.map(lambda a: a[0, 0], s))

  def loss(state, view: bool):
    run = nnx.merge(graphdef, state)
    layer = first(cast_to_compute(run) if view else run)
    return jnp.sum(layer.mlp(layer.norm2(x)).astype(jnp.float32) ** 2) + jnp.sum(
      layer.attn.o_proj(x.reshape(B, T, 4, 8)).astype(jnp.float32))

  plain, cast = (jax.jit(jax.value_and_grad(loss), static_argnums=1)(state, v) for v in (False, True))
  np.testing.assert_array_equal(np.asarray(plain[0]), np.asarray(cast[0]))
  for a, b in zip(jax.tree.leaves(plain[1]), jax.tree.leaves(cast[1])):
    assert a.dtype == b.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  view = nnx.state(cast_to_compute(layers))
  assert view["mlp"]["up"]["kernel"].dtype == view["attn"]["o_proj"]["kernel"].dtype == jnp.bfloat16
  assert view["norm1"]["scale"].dtype == jnp.float32


def _nested_scan_carries(jaxpr, depth=0) -> list:
  """The shapes a scan inside a scan carries from one iteration to the next."""
  found = []
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "scan" and depth:
      start = eqn.params["num_consts"]
      found += [tuple(v.aval.shape) for v in eqn.invars[start:start + eqn.params["num_carry"]]]
    for sub in jax.extend.core.jaxprs_in_params(eqn.params):
      found += _nested_scan_carries(sub, depth + (eqn.primitive.name == "scan"))
  return found


@pytest.mark.parametrize("policy", ["full", "save_qkv_proj"])
def test_a_reuser_sends_its_gradient_through_its_source_projections_at_once(policy):
  """A probability reuser's gradient into its source's Q and K goes through the source's projections inside the
  reuser's backward pass (scores.SourceProjection): the backward pass of a run of reusers carries the gradient of the
  source's input [B, T, D], not the gradients of its queries and keys [B, T, H, d] and [B, T, G, d] from layer to
  layer (twice the bytes with multi-head attention)."""
  cfg = tiny_config(*LONG_RUNS["uniattn"], f"model.remat={policy}")
  _, graphdef, params = randomized(cfg)
  jaxpr = jax.make_jaxpr(jax.grad(lambda p: jnp.mean(nnx.merge(graphdef, p)(tokens(b=B, t=T)))))(params)
  carries = _nested_scan_carries(jaxpr.jaxpr)
  assert (B, T, 32) in carries, carries  # the reusers' scans: the residual stream and its gradient
  assert not [s for s in carries if len(s) == 4 and s[:2] == (B, T)], carries
