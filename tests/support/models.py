"""Models for tests: random parameters (memoised), jitted forwards and gradients, token batches, and the comparison
of a model's loss and gradients under an attention implementation with XLA's."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from conftest import tiny_config
from jaxshare.config.catalogue import schedule_matrix
from jaxshare.init.headwise import compute_ties
from jaxshare.plan import plan_of
from jaxshare.model import build_model


def randomized(cfg, seed=0):
  """A model whose every parameter (norm scales and biases included) is random, and its pure-dict params.
  Memoised per (config, seed): the parametrised tests of a schedule share one model (building one eagerly costs
  more than its jitted forward), and its graph definition, equal across them, hits the jitted forwards' caches."""
  key = (repr(cfg), seed)  # configs hold lists: unhashable, but a frozen config's repr names it
  if key not in _RANDOMIZED:
    _RANDOMIZED[key] = _build_randomized(cfg, seed)
  schedule, graphdef, params = _RANDOMIZED[key]
  return schedule, graphdef, jax.tree.map(lambda a: a, params)  # new dicts: a caller's edit stays its own


_RANDOMIZED: dict = {}


def _build_randomized(cfg, seed):
  plan = plan_of(cfg)
  schedule = plan.schedule
  model = build_model(plan, seed, compute_ties(plan, seed))
  graphdef, state = nnx.split(model, nnx.Param)
  leaves, treedef = jax.tree.flatten(nnx.to_pure_dict(state))
  keys = jax.random.split(jax.random.key(seed + 1), len(leaves))
  leaves = [x + 0.1 * jax.random.normal(k, x.shape, x.dtype) for x, k in zip(leaves, keys)]
  params = jax.tree.unflatten(treedef, leaves)
  return schedule, graphdef, params


@functools.partial(jax.jit, static_argnums=0)
def forward(graphdef, params, x):
  """The model's logits for ``x``, jitted: one dispatch instead of one per op (eager forwards dominated these
  tests' time). Equivalences between two models compare two jitted forwards."""
  return nnx.merge(graphdef, params)(x)


@functools.partial(jax.jit, static_argnums=0)
def loss_and_grads(graphdef, params, x):
  """``mean(logits ** 2)`` and its gradient with respect to every parameter, jitted."""
  return jax.value_and_grad(lambda p: jnp.mean(nnx.merge(graphdef, p)(x) ** 2))(params)


def tokens(b=2, t=12, vocab=256, seed=0):
  return jax.random.randint(jax.random.key(seed), (b, t), 0, vocab, dtype=jnp.int32)


def abstract_graphdef(cfg):
  """The model's graph definition, traced abstractly (no parameters allocated)."""
  ties = compute_ties(plan_of(cfg), 0)  # concrete: head-wise sharing's ties are computed from weights
  model = nnx.eval_shape(lambda: build_model(plan_of(cfg), 0, ties))
  return nnx.split(model, nnx.Param)[0]


def kernel_loss_and_grads(graphdef, params, batch=2):
  x = tokens(b=batch, t=21)  # not a power of two: the kernels pad and mask

  def loss(p):
    logits = nnx.merge(graphdef, p)(x)
    return jnp.mean(jax.nn.log_softmax(logits.astype(jnp.float32))[..., 0])

  return jax.jit(jax.value_and_grad(loss))(params)


def assert_model_equals_xla(name: str, impl: str, *overrides: str) -> None:
  """The model of the catalogue's ``kernels[name]`` (and ``overrides``) under ``attention.impl=impl`` has xla's loss
  and gradients."""
  case = [*schedule_matrix("kernels")[name], *overrides]
  _, graphdef, params = randomized(tiny_config(*case, f"attention.impl={impl}"))
  la, ga = kernel_loss_and_grads(graphdef, params)
  lb, gb = kernel_loss_and_grads(abstract_graphdef(tiny_config(*case, "attention.impl=xla")), params)
  # bf16: cotangents shared by several readers accumulate in bf16 in the order XLA schedules them; a change of that
  # order moved a bf16 LISA_plus gradient element by 5 ulps on both sides (2.3% of its leaf's largest)
  tol = 3e-2 if name.startswith("bf16") or "model.dtype=bfloat16" in overrides else 1e-5
  np.testing.assert_allclose(float(la), float(lb), rtol=tol)
  for (path, u), v in zip(jax.tree_util.tree_leaves_with_path(ga), jax.tree.leaves(gb)):
    u, v = np.asarray(u, np.float32), np.asarray(v, np.float32)
    np.testing.assert_allclose(u, v, atol=tol * max(np.abs(v).max(), 1e-3), err_msg=jax.tree_util.keystr(path))
