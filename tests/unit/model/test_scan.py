"""The scan over stacked layers: scan_deferring_gradients computes what nnx.scan computes, values and every gradient
(parameters, carry, per-item inputs, through outputs too), under every checkpoint policy, keeps no second copy of
its inputs, and makes its parameters' gradient stacks from the incoming cotangent; a model's stacks defer theirs
exactly when another stack follows them, with the same loss and gradients."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax._src.ad_checkpoint import saved_residuals

from conftest import tiny_config
from jaxshare.config.catalogue import schedule_matrix
from jaxshare.model import transformer
from jaxshare.model.scan import scan_deferring_gradients, scan_or_unroll
from support.models import randomized, tokens

COUNT, B, D = 3, 2, 8
POLICIES = {"none": "none", "full": None, "dots": jax.checkpoint_policies.checkpoint_dots}


class Layer(nnx.Module):
  def __init__(self, rngs: nnx.Rngs):
    self.w = nnx.Param(jax.random.normal(rngs.params(), (D, D)) * 0.5)
    self.scale = nnx.Param(1.0 + 0.1 * jax.random.normal(rngs.params(), (D,)))


@nnx.split_rngs(splits=COUNT)
@nnx.vmap(in_axes=(0,), out_axes=0)
def make_layers(rngs: nnx.Rngs) -> Layer:
  return Layer(rngs)


def layer_fn(policy):
  """One layer: reads its parameters, the carry, a per-layer input and a constant; returns the carry and an output."""
  def fn(layer: Layer, x, item, offset):
    h = jnp.tanh(x @ layer.w[...] + item)
    y = jnp.sin(h @ layer.w[...].T) * layer.scale[...] + x + offset
    return y, jnp.sum(h * h, axis=-1)
  return fn if policy == "none" else nnx.remat(fn, policy=POLICIES[policy])


def inputs():
  layers = make_layers(nnx.Rngs(0))
  x = jax.random.normal(jax.random.key(1), (B, D))
  items = jax.random.normal(jax.random.key(2), (COUNT, B, D))
  offset = jax.random.normal(jax.random.key(3), (B, D))
  return layers, x, items, offset


def loss(scan, policy):
  graphdef, _ = nnx.split(make_layers(nnx.Rngs(0)))

  def value(state, x, items, offset):
    y, ys = scan(layer_fn(policy), nnx.merge(graphdef, state), x, items, (offset,))
    return jnp.sum(y ** 2) + jnp.sum(jnp.cos(ys))  # the outputs' cotangents are not zero
  return value


def plain_scan(fn, modules, carry, per_item, consts):
  return scan_or_unroll(fn, modules, carry, per_item, count=COUNT, scan=True, consts=consts)


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_the_deferring_scan_computes_what_nnx_scan_computes(policy):
  layers, x, items, offset = inputs()
  state = nnx.state(layers)
  got = jax.jit(jax.value_and_grad(loss(scan_deferring_gradients, policy), argnums=(0, 1, 2)))(state, x, items,
                                                                                               offset)
  want = jax.jit(jax.value_and_grad(loss(plain_scan, policy), argnums=(0, 1, 2)))(state, x, items, offset)
  np.testing.assert_allclose(float(got[0]), float(want[0]), rtol=1e-6)
  assert jax.tree.structure(got[1]) == jax.tree.structure(want[1])
  for a, b in zip(jax.tree.leaves(got[1]), jax.tree.leaves(want[1])):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("policy", ["full", "dots"])
def test_the_deferring_scan_keeps_no_second_copy_of_its_inputs(policy):
  """Its forward pass keeps what nnx.scan's keeps: the checkpoints' residuals, each layer's carry, and the stacked
  parameters and per-item inputs themselves, not a stacked copy of them (nor of the constant)."""
  layers, x, items, offset = inputs()

  def kept(scan):
    found = saved_residuals(loss(scan, policy), nnx.state(layers), x, items, offset)
    return sorted(tuple(aval.shape) for aval, source in found if "argument" not in source)
  assert kept(scan_deferring_gradients) == kept(plain_scan)
  assert (COUNT, D, D) not in kept(scan_deferring_gradients) and (COUNT, B, D) in kept(scan_deferring_gradients)


def _barriered_gradient_stacks(jaxpr) -> list[tuple[int, ...]]:
  """Shapes of the arrays broadcast from a scalar that leaves an optimisation barrier beside a non-scalar value."""
  tied, found = set(), []  # ids: a jaxpr's literals are unhashable
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "optimization_barrier" and any(v.aval.ndim for v in eqn.invars):
      tied |= {id(v) for v in eqn.outvars if not v.aval.ndim}
    elif eqn.primitive.name == "broadcast_in_dim" and id(eqn.invars[0]) in tied:
      found.append(tuple(eqn.outvars[0].aval.shape))
    elif eqn.primitive.name == "convert_element_type" and id(eqn.invars[0]) in tied:
      tied.add(id(eqn.outvars[0]))
    for sub in jax.extend.core.jaxprs_in_params(eqn.params):
      found += _barriered_gradient_stacks(sub)
  return found


def test_the_parameters_gradient_stacks_are_made_from_the_incoming_cotangent():
  """jax's scan transpose makes its stacked inputs' gradients from zeros with no operand, which XLA may place at the
  top of the step; the deferring scan's zeros leave an optimisation barrier with the cotangent of its carry."""
  layers, x, items, offset = inputs()
  grad = jax.grad(loss(scan_deferring_gradients, "full"))
  stacks = _barriered_gradient_stacks(jax.make_jaxpr(grad)(nnx.state(layers), x, items, offset).jaxpr)
  assert sorted(stacks) == [(COUNT, D), (COUNT, D, D)], stacks
  assert not _barriered_gradient_stacks(
    jax.make_jaxpr(jax.grad(loss(plain_scan, "full")))(nnx.state(layers), x, items, offset).jaxpr)


FAMILIES = schedule_matrix("families")
MULTI_STACK = ["cla+uniattn", "lisa_plus", "uniattn"]  # a stack of one-layer superblocks, then others


def _loss_and_grads(cfg, params, defer: bool, monkeypatch):
  if not defer:  # every stack's scan plain, as before stacks deferred their gradients
    monkeypatch.setattr(transformer, "scan_or_unroll",
                        lambda *a, defer_gradients=False, **k: scan_or_unroll(*a, **k))
  _, graphdef, _ = randomized(cfg)
  x = tokens(b=2, t=12)
  out = jax.jit(jax.value_and_grad(lambda p: jnp.mean(jax.nn.log_softmax(nnx.merge(graphdef, p)(x))[..., 1])))(params)
  monkeypatch.undo()
  return out


@pytest.mark.parametrize("policy", ["full", "save_qkv_proj"])
@pytest.mark.parametrize("name", MULTI_STACK)
def test_a_stack_followed_by_another_defers_its_gradients_and_changes_no_number(name, policy, monkeypatch):
  cfg = tiny_config(*FAMILIES[name], f"model.remat={policy}")
  model = nnx.merge(*randomized(cfg)[1:])
  assert [stack.followed for stack in model.stacks] == [True] * (len(model.stacks) - 1) + [False]
  assert len(model.stacks) > 1 and model.stacks[0].scan
  _, _, params = randomized(cfg)
  got, want = (_loss_and_grads(cfg, params, defer, monkeypatch) for defer in (True, False))
  np.testing.assert_allclose(float(got[0]), float(want[0]), rtol=1e-6)
  for a, b in zip(jax.tree.leaves(got[1]), jax.tree.leaves(want[1])):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
