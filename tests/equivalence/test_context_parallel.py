"""Context parallelism (mesh.context, jaxshare.context): on 8 host devices, the loss and every gradient of the sequence
split over 2, 4 and 8 devices (mixed with data and fsdp) equal one device's, for every kind of the schedule catalogue,
on packed documents, with the keys gathered and round the ring (attention.context_strategy); the load-balanced layout
gives every device the same causal work; the Pallas kernels attend a device's query chunks by offset inside the
model; the ring's backward pass runs no chunk pair's forward again."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from conftest import tiny_config
from jaxshare import context, parallel
from jaxshare.config import MeshConfig
from jaxshare.config.catalogue import schedule_matrix
from support.models import randomized

MATRIX = schedule_matrix("context_parallel")
# (context, data, fsdp): every context size, each beside another axis but the largest (8 devices in all)
MESHES = [(2, 2, 2), (4, 1, 2), (8, 1, 1)]
T = 48  # a multiple of 2 x 8: two chunks per device at context 8


def packed(batch=4, length=T, seed=0):
  """Rows of 3-5 packed documents: tokens, positions restarting at each document, document ids."""
  rng = np.random.default_rng(seed)
  tokens = rng.integers(0, 256, (batch, length)).astype(np.int32)
  segments, positions = np.zeros((batch, length), np.int32), np.zeros((batch, length), np.int32)
  for r in range(batch):
    cuts = np.sort(rng.choice(np.arange(1, length), 2 + r % 3, replace=False))
    for d, (a, b) in enumerate(zip([0, *cuts], [*cuts, length])):
      segments[r, a:b], positions[r, a:b] = d + 1, np.arange(b - a)
  return jnp.asarray(tokens), jnp.asarray(positions), jnp.asarray(segments)


def loss_and_grads(graphdef, params, batch, mesh_sizes=None):
  def loss(p, tokens, positions, segments):
    logits = nnx.merge(graphdef, p)(tokens, positions, segments)
    return jnp.mean(jax.nn.log_softmax(logits)[..., 7] * jnp.cos(positions.astype(jnp.float32)))

  step = jax.value_and_grad(loss)
  if mesh_sizes is None:
    return jax.jit(step)(params, *batch)
  c, data, fsdp = mesh_sizes
  mesh = parallel.make_mesh(MeshConfig(data=data, fsdp=fsdp, context=c), jax.devices()[:c * data * fsdp])
  with jax.set_mesh(mesh):
    return jax.jit(step)(params, *batch)


def assert_same(reference, other, what):
  (l0, g0), (l1, g1) = reference, other
  np.testing.assert_allclose(float(l1), float(l0), rtol=1e-5, err_msg=what)
  for path, a, b in zip(jax.tree.leaves_with_path(g0), jax.tree.leaves(g0), jax.tree.leaves(g1)):
    # relative in the Frobenius norm. Full LISA's ffn aligner gradient sums terms of opposite signs (its units read
    # +-(A + A_delta)), whose float32 rounding follows the order: on 4 devices it is 1.6e-4 off one device's with the
    # batch split over data x fsdp alone, as with the sequence split (context parallelism adds nothing to that)
    name = jax.tree_util.keystr(path[0])
    error = float(jnp.linalg.norm(a - b) / (jnp.linalg.norm(a) + 1e-12))
    assert error <= (5e-4 if "align" in name else 1e-4), f"{what}: gradient {name} differs by {error:.2e} of its norm"


@pytest.mark.parametrize("strategy", ["all_gather", "ring"])
@pytest.mark.parametrize("name", sorted(MATRIX))
def test_context_parallel_loss_and_gradients_equal_one_device(name, strategy):
  cfg = tiny_config(*MATRIX[name], f"data.seq_len={T}")
  _, graphdef, params = randomized(cfg)
  _, graphdef_split, _ = randomized(tiny_config(*MATRIX[name], f"data.seq_len={T}",
                                                f"attention.context_strategy={strategy}"))
  batch = packed()
  reference = loss_and_grads(graphdef, params, batch)
  assert np.isfinite(float(reference[0]))
  # the ring on the smallest and the largest context (4 is the Pallas test's), to keep the suite's time
  for sizes in MESHES if strategy == "all_gather" else MESHES[::2]:
    assert_same(reference, loss_and_grads(graphdef_split, params, batch, sizes),
                f"{name} {strategy} context/data/fsdp={sizes}")


@pytest.mark.parametrize("strategy", ["all_gather", "ring"])
@pytest.mark.parametrize("name", ["dense", "uniattn", "lisa_plus"])
def test_pallas_kernels_attend_query_chunks_by_offset(name, strategy):
  """attention.impl=pallas_interpret under context parallelism: the flash kernels (own scores, probability reuse,
  LISA_plus's features) run each device's two query chunks with their offsets (against the gathered keys, or each
  key chunk of the ring), as XLA does on one device."""
  cfg = tiny_config(*MATRIX[name], f"data.seq_len={T}", "attention.impl=pallas_interpret",
                    f"attention.context_strategy={strategy}")
  _, graphdef, params = randomized(cfg)
  _, graphdef_xla, _ = randomized(tiny_config(*MATRIX[name], f"data.seq_len={T}", "attention.impl=xla"))
  batch = packed(batch=2)
  assert_same(loss_and_grads(graphdef_xla, params, batch), loss_and_grads(graphdef, params, batch, (4, 1, 2)),
              f"{name} pallas_interpret {strategy} at context 4")


@pytest.mark.parametrize("shards", [1, 2, 4, 8])
def test_the_load_balanced_layout_gives_every_device_equal_causal_work(shards):
  length = 2 * shards * 6
  order = context.layout(length, shards)
  assert sorted(order.tolist()) == list(range(length))
  per_device = order.reshape(shards, -1)
  chunk = length // (2 * shards)
  for i, tokens in enumerate(per_device):  # chunks i and 2c-1-i
    assert tokens.tolist() == [*range(i * chunk, (i + 1) * chunk), *range((2 * shards - 1 - i) * chunk,
                                                                          (2 * shards - i) * chunk)]
  work = [(tokens + 1).sum() for tokens in per_device]  # a query at position t sees t + 1 keys
  assert len(set(work)) == 1, work
  x = jnp.arange(2 * length).reshape(2, length)
  np.testing.assert_array_equal(context.in_order(x[:, order], 1, shards), x)


def test_a_sequence_that_does_not_split_is_refused():
  with pytest.raises(ValueError, match="multiple of 16 tokens, not 40"):
    context.layout(40, 8)


def test_the_ring_backward_runs_no_chunk_pair_forward_again():
  """The ring's backward pass runs the kernel's backward alone per chunk pair (jaxshare.kernels.xla
  .attention_backward, from the whole rows' output and log-sum-exp): the train step's matmul FLOPs equal the gathered
  step's (local queries against every key either way), where a vjp per pair would run each pair's forward again."""
  from jaxshare.aot.report import matmul_flops
  from jaxshare.kernels import ring

  def flops(strategy):
    cfg = tiny_config(*MATRIX["uniattn"], f"data.seq_len={T}", f"attention.context_strategy={strategy}")
    _, graphdef, params = randomized(cfg)

    def loss(p, tokens, positions, segments):
      return jnp.mean(nnx.merge(graphdef, p)(tokens, positions, segments))

    mesh = parallel.make_mesh(MeshConfig(context=4, fsdp=2), jax.devices()[:8])
    with jax.set_mesh(mesh):
      return matmul_flops(jax.make_jaxpr(jax.value_and_grad(loss))(params, *packed()))[0]

  gathered, rotated = flops("all_gather"), flops("ring")
  assert rotated == pytest.approx(gathered, rel=1e-9)
  with pytest.MonkeyPatch.context() as patch:  # the vjp per pair, which the test must tell apart
    whole = ring.ring_attention
    patch.setattr(ring, "ring_attention", lambda *args, block_grad=None, **kwargs: whole(*args, **kwargs))
    assert flops("ring") > 1.05 * gathered  # 1.074x: each pair's two forward matmuls again
