"""The tiled language-modelling loss (train.num_vocab_tiling): the cross-entropy and its gradients of the whole logits,
without a [B, T, V] array anywhere in the traced step."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from conftest import tiny_config
from jaxshare.data.batch import Batch
from jaxshare.model.loss import lm_loss, masked_cross_entropy, tiled_cross_entropy
from support.models import randomized

B, T, D, V = 2, 8, 16, 48


def _batch(seed=0, vocab=V):
  k = jax.random.split(jax.random.key(seed), 3)
  targets = jax.random.randint(k[0], (B, T), 0, vocab)
  mask = (jax.random.uniform(k[1], (B, T)) > 0.25).astype(jnp.int32)
  return Batch(targets, targets, jnp.broadcast_to(jnp.arange(T), (B, T)), jnp.ones((B, T), jnp.int32), mask)


@pytest.mark.parametrize("tiles", [1, 2, 3, 8, 48])
def test_tiled_cross_entropy_equals_the_whole_logits(tiles):
  k = jax.random.split(jax.random.key(1), 2)
  hidden, head = jax.random.normal(k[0], (B, T, D)), 3 * jax.random.normal(k[1], (D, V))  # peaked rows
  batch = _batch()
  whole = lambda h, w: masked_cross_entropy(jnp.einsum("btd,dv->btv", h, w), batch)[0]  # noqa: E731
  tiled = lambda h, w: tiled_cross_entropy(h, w, batch, tiles)[0]  # noqa: E731
  (a, ga), (b, gb) = (jax.value_and_grad(f, (0, 1))(hidden, head) for f in (whole, tiled))
  np.testing.assert_allclose(float(b), float(a), rtol=1e-6)
  for x, y in zip(ga, gb):  # peaked logits (~12 standard deviations): float32 rounding of the online log-sum-exp
    np.testing.assert_allclose(np.asarray(y), np.asarray(x), atol=1e-4, rtol=1e-4)
  assert float(tiled_cross_entropy(hidden, head, batch, tiles)[1]) == float(jnp.sum(batch.loss_mask))


def test_a_tiling_that_does_not_divide_the_vocabulary_is_refused():
  with pytest.raises(ValueError, match="train.num_vocab_tiling=5 must divide the vocabulary size 48"):
    tiled_cross_entropy(jnp.zeros((B, T, D)), jnp.zeros((D, V)), _batch(), 5)


@pytest.mark.parametrize("tied", [False, True])
def test_the_model_loss_over_tiles_never_holds_whole_logits(tied):
  cfg = tiny_config(f"model.tie_embeddings={str(tied).lower()}")
  _, graphdef, params = randomized(cfg)
  batch = _batch(vocab=cfg.model.vocab_size)
  loss = lambda p, tiles: lm_loss(nnx.merge(graphdef, p), batch, tiles)[0]  # noqa: E731
  (a, ga), (b, gb) = (jax.jit(jax.value_and_grad(loss), static_argnums=1)(params, t) for t in (1, 4))
  np.testing.assert_allclose(float(b), float(a), rtol=1e-6)
  for x, y in zip(jax.tree.leaves(ga), jax.tree.leaves(gb)):
    np.testing.assert_allclose(np.asarray(y), np.asarray(x), atol=1e-5, rtol=1e-4)
  jaxpr = jax.make_jaxpr(jax.grad(loss), static_argnums=1)(params, 4)
  whole = (B, T, cfg.model.vocab_size)

  def shapes(jaxpr):
    for eqn in jaxpr.eqns:
      yield from (tuple(v.aval.shape) for v in eqn.outvars if hasattr(v.aval, "shape"))
      for sub in jax.extend.core.jaxprs_in_params(eqn.params):
        yield from shapes(sub)

  assert whole not in set(shapes(jaxpr.jaxpr))
