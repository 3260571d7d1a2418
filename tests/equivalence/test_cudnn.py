"""cuDNN attention (``attention.impl=cudnn``): the packed layout describes exactly the documents the reference mask
separates; the arguments handed to cuDNN, read with cuDNN's documented meaning by an XLA stand-in, give the
reference's values and gradients in every role; off a GPU the implementation is refused by name. That the real cuDNN
lowers and compiles these calls for an H100 is proven in tests/integration/aot/test_aot.py (no GPU runs here)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxshare.config import ConfigError
from jaxshare.config.catalogue import schedule_matrix
from jaxshare.kernels import cudnn, dispatch, reference
from conftest import tiny_config
from support.models import abstract_graphdef, assert_model_equals_xla, kernel_loss_and_grads, randomized


def _segments(rows: list[list[int]]) -> jnp.ndarray:
  """Segment ids of rows given as document lengths (ids counting from 1)."""
  return jnp.asarray([np.repeat(np.arange(1, len(r) + 1), r) for r in rows], jnp.int32)


def _documents(lengths, offsets, t):
  """Each token's document ``[B, T]`` under cuDNN's packed layout (-1: in none), read back from lengths and offsets
  (traceable, so that the stand-in below runs under jit and lax.cond)."""
  lengths, offsets = jnp.asarray(lengths), jnp.asarray(offsets)
  position = jnp.arange(t)[None, None, :]
  start, n = offsets[:, :-1, None], lengths[:, :, None]
  inside = (n > 0) & (start >= 0) & (position >= start) & (position < start + n)  # [B, M, T]
  return jnp.max(jnp.where(inside, jnp.arange(lengths.shape[1])[None, :, None], -1), axis=1)


@pytest.mark.parametrize("rows", [[[16], [5, 11]], [[1] * 16, [3, 3, 3, 7]], [[15, 1], [8, 8]]])
def test_packing_holds_the_documents_the_reference_mask_separates(rows):
  seg = _segments(rows)
  lengths, offsets = cudnn.packing(seg, seg.shape[1])
  assert lengths.shape == (2, 16) and offsets.shape == (2, 17)
  doc = np.asarray(_documents(lengths, offsets, 16))
  assert (doc >= 0).all()  # every token is in a document
  same = doc[:, :, None] == doc[:, None, :]
  np.testing.assert_array_equal(same, reference.attention_mask(seg, seg, causal=False))
  for b, row in enumerate(rows):  # -1 past the row's last document
    assert (np.asarray(lengths[b, len(row):]) == -1).all() and (np.asarray(offsets[b, len(row):]) == -1).all()


def _xla_stand_in(q, k, v, bias, mask, q_seqlen, kv_seqlen, q_offsets, kv_offsets, *, scale, mask_type, qkv_layout,
                  sliding_window_length):
  """cuDNN's packed-layout contract (jax's fused_attention_stablehlo docstring) in XLA: tokens attend within their
  document (without lengths and offsets, the row is one document); (PADDING_)CAUSAL also masks later keys; a sliding
  window of n keeps keys with t - s < n."""
  assert bias is None and mask is None and qkv_layout == "BTNH"
  assert q.shape[-1] % 8 == 0 and v.shape[-1] % 8 == 0, "jax's check: head widths are multiples of 8"
  kinds = cudnn.cudnn_attention.MaskType
  b, t, s = q.shape[0], q.shape[1], k.shape[1]
  if q_seqlen is None:
    assert mask_type in (kinds.CAUSAL, kinds.NO_MASK) and kv_seqlen is None and q_offsets is None
    allowed = jnp.ones((b, t, s), bool)
  else:
    assert mask_type in (kinds.PADDING_CAUSAL, kinds.PADDING)
    q_doc, k_doc = _documents(q_seqlen, q_offsets, t), _documents(kv_seqlen, kv_offsets, s)
    allowed = (q_doc[:, :, None] == k_doc[:, None, :]) & (q_doc[:, :, None] >= 0)
  offset = jnp.arange(t)[:, None] - jnp.arange(s)[None, :]
  if mask_type in (kinds.PADDING_CAUSAL, kinds.CAUSAL):
    allowed &= offset >= 0
  if sliding_window_length:
    allowed &= offset < sliding_window_length
  # jax.nn.dot_product_attention's own XLA path takes no V narrower than Q/K (cuDNN's MLA path does)
  k, v = (jnp.repeat(x, q.shape[2] // x.shape[2], axis=2) for x in (k, v))
  logits = jnp.einsum("bthe,bshe->bhts", q, k, preferred_element_type=jnp.float32) * scale
  probs = jax.nn.softmax(jnp.where(allowed[:, None], logits, -1e30), axis=-1)
  return jnp.einsum("bhts,bshd->bthd", probs.astype(v.dtype), v, preferred_element_type=jnp.float32).astype(q.dtype)


@pytest.fixture
def stand_in(monkeypatch):
  """cuDNN as the XLA stand-in, run on any platform (no GPU here); returns the stand-in's calls' (Q/K, V) widths."""
  widths = []

  def call(q, k, v, *args, **kwargs):
    widths.append((q.shape[-1], v.shape[-1]))
    return _xla_stand_in(q, k, v, *args, **kwargs)
  monkeypatch.setattr(cudnn.cudnn_attention, "dot_product_attention", call)
  monkeypatch.setitem(dispatch._LIBRARIES, "cudnn", dataclasses.replace(dispatch._LIBRARIES["cudnn"], platform=None))
  return widths


def _as_gpu(monkeypatch, capability: str | None) -> None:
  """jax's cuDNN checks answer as for a GPU of this compute capability with cuDNN 9.28 (None: no cuDNN GPU)."""
  have = tuple(map(int, capability.split("."))) if capability else None
  monkeypatch.setattr(cudnn.cudnn_attention, "check_compute_capability",
                      lambda c: have is not None and have >= tuple(map(int, c.split("."))))
  monkeypatch.setattr(cudnn.cudnn_attention, "check_cudnn_version", lambda: 92800)


# (H, Gk, Gv): MHA, GQA, and a reuser's V heads other than its source's K heads.
@pytest.mark.parametrize("heads", [(4, 4, 4), (4, 2, 2), (4, 1, 2)])
@pytest.mark.parametrize("causal,window", [(True, 0), (False, 0), (True, 5)])
def test_arguments_handed_to_cudnn_mean_the_reference_attention(monkeypatch, heads, causal, window):
  monkeypatch.setattr(cudnn.cudnn_attention, "dot_product_attention", _xla_stand_in)
  h, gk, gv = heads
  keys = jax.random.split(jax.random.key(h * 7 + gk + gv), 4)
  q, k, v = (jax.random.normal(key, (2, 16, n, 16), jnp.bfloat16).astype(jnp.float32).astype(jnp.bfloat16)
             for key, n in zip(keys, (h, gk, gv)))
  w = jax.random.normal(keys[3], (2, 16, h, 16))
  seg = _segments([[6, 10], [16]])
  regroup = lambda x: jnp.repeat(x, h // x.shape[2], axis=2)  # noqa: E731

  def loss(fn, q, k, v):
    return jnp.sum(fn(q, k, v, seg, seg, causal=causal, window=window, scale=0.3).astype(jnp.float32) * w)

  got = jax.grad(lambda *a: loss(cudnn.attention, *a), argnums=(0, 1, 2))(q, k, v)
  want = jax.grad(lambda q, k, v: loss(reference.attention, q, regroup(k), regroup(v)), argnums=(0, 1, 2))(q, k, v)
  np.testing.assert_allclose(np.asarray(cudnn.attention(q, k, v, seg, seg, causal=causal, window=window, scale=0.3),
                                        np.float32),
                             np.asarray(reference.attention(q, regroup(k), regroup(v), seg, seg, causal=causal,
                                                            window=window, scale=0.3), np.float32), atol=2e-2)
  for g, r in zip(got, want):
    np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(r, np.float32),
                               atol=3e-2 * float(jnp.abs(r.astype(jnp.float32)).max()))


def test_queries_wider_than_values_run_on_hopper_zero_padded(monkeypatch):
  """A LISA_plus chain read in bf16 is attention with Q/K wider than V (64 + 44 = 108 over 64): cuDNN runs it where
  jax's MLA path exists (Hopper, cuDNN >= 9.10), its features zero-padded to a multiple of 8 (jax's check, which the
  stand-in asserts), with the reference's values and gradients; elsewhere it is refused by name."""
  monkeypatch.setattr(cudnn.cudnn_attention, "dot_product_attention", _xla_stand_in)
  keys = jax.random.split(jax.random.key(5), 4)
  q, k = (jax.random.normal(key, (2, 16, 4, 108), jnp.bfloat16) for key in keys[:2])
  v = jax.random.normal(keys[2], (2, 16, 2, 64), jnp.bfloat16)
  monkeypatch.setattr(cudnn, "wide_queries", lambda: False)
  assert "Q/K up to 256 over V of a multiple of 8 on Hopper" in cudnn.unsupported(q, k[:, :, :2], v)
  monkeypatch.setattr(cudnn, "wide_queries", lambda: True)
  assert cudnn.unsupported(q, k[:, :, :2], v) is None
  assert "head widths 264/64" in cudnn.unsupported(jnp.ones((1, 16, 4, 264), jnp.bfloat16),
                                                   jnp.ones((1, 16, 2, 264), jnp.bfloat16), v[:1])
  seg = _segments([[6, 10], [16]])
  w = jax.random.normal(keys[3], (2, 16, 4, 64))
  regroup = lambda x: jnp.repeat(x, 2, axis=2)  # noqa: E731

  for scale in (1.0, None):  # None: 1/√108, the unpadded width's
    def loss(fn, q, k, v):
      return jnp.sum(fn(q, k, v, seg, seg, scale=scale).astype(jnp.float32) * w)
    got = jax.value_and_grad(lambda *a: loss(cudnn.attention, *a), argnums=(0, 1, 2))(q, k[:, :, :2], v)
    want = jax.value_and_grad(lambda q, k, v: loss(reference.attention, q, regroup(k), regroup(v)),
                              argnums=(0, 1, 2))(q, k[:, :, :2], v)
    for g, r in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
      np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(r, np.float32),
                                 atol=3e-2 * float(jnp.abs(r.astype(jnp.float32)).max()), err_msg=str(scale))


def test_a_bf16_lisa_plus_chain_runs_cudnn_and_equals_xla(monkeypatch, stand_in):
  """``attention.chain_dtype=compute`` in a bf16 LISA_plus model: on Hopper (as jax's checks would answer) cuDNN runs
  the chain's attention, Q/K wider than V, and the model has xla's loss and gradients in the same dtype, and, to
  bf16 rounding, the loss of the float32 chain."""
  monkeypatch.setattr(cudnn, "wide_queries", lambda: True)
  assert_model_equals_xla("bf16_lisa_plus", "cudnn", "attention.chain_dtype=compute")
  assert any(e > d for e, d in stand_in), stand_in  # the chain ran on cuDNN
  case = schedule_matrix("kernels")["bf16_lisa_plus"]
  _, _, params = randomized(tiny_config(*case, "attention.impl=xla"))
  losses = [float(kernel_loss_and_grads(abstract_graphdef(tiny_config(*case, "attention.impl=xla",
                                                        f"attention.chain_dtype={dtype}")), params)[0])
            for dtype in ("float32", "compute")]
  np.testing.assert_allclose(*losses, rtol=2e-2)


def test_cudnn_refuses_what_it_cannot_run_by_name():
  f32 = jnp.ones((1, 16, 2, 16))
  assert cudnn.unsupported(f32, f32, f32) == "cuDNN flash attention takes bfloat16 or float16, not float32"
  wide = jnp.ones((1, 16, 2, 176), jnp.bfloat16)
  assert "head widths 176/176" in cudnn.unsupported(wide, wide, wide)
  x = jnp.ones((1, 16, 2, 16), jnp.bfloat16)
  seg = jnp.ones((1, 16), jnp.int32)
  with pytest.raises(ConfigError, match="attention.impl=cudnn runs on GPUs; this run compiles for cpu. Use auto"):
    dispatch.get_attention("cudnn").attention(x, x, x, seg, seg)


def test_document_bounds_name_the_traces_worth_making(monkeypatch):
  """cuDNN in bf16/fp16 (``cudnn``, and ``auto`` compiling for a GPU): one document (no packed layout), up to
  MAX_DOCUMENTS (packed) on Hopper, one alone before it (no packed layout there); in float32 cuDNN refuses every
  call, and implementations without a document limit need no bounds: no extra traces."""
  assert dispatch.document_bounds("cudnn", "bfloat16", "cpu") == (1, cudnn.MAX_DOCUMENTS)
  assert dispatch.document_bounds("cudnn", "float16", "cpu") == (1, cudnn.MAX_DOCUMENTS)
  assert dispatch.document_bounds("cudnn", "float32", "cpu") is None
  for impl in ("auto", "pallas", "xla", "splash"):
    assert dispatch.document_bounds(impl, "bfloat16", "cpu") is None
  assert dispatch.document_bounds("auto", "bfloat16", "tpu") is None
  for capability, want in (("9.0", (1, cudnn.MAX_DOCUMENTS)), ("8.0", (1,)), ("7.0", None)):  # H100, A100, V100
    _as_gpu(monkeypatch, capability)
    assert dispatch.document_bounds("auto", "bfloat16", "gpu") == dispatch.document_bounds("cudnn", "bfloat16",
                                                                                           "gpu") == want
    assert dispatch.document_bounds("auto", "float32", "gpu") is None


def test_auto_runs_cudnn_on_gpus_and_splash_on_tpus(monkeypatch):
  """``attention.impl=auto`` compiling for a GPU runs cuDNN for every role it takes (a bf16 model's attention and
  probability reuse over the source's Q and K), jaxshare's kernels for what it refuses (float32 features) and on GPUs
  without cuDNN flash attention (before Ampere, ROCm): probability reuse too, as tiled attention over the source's Q
  and K; on a TPU splash; on a CPU XLA. Which kernel ran is read from stand-ins that mark their outputs."""
  marks = {"cudnn": 3.0, "splash": 5.0, "pallas": 7.0, "pallas_reuse": 9.0}
  marked = lambda name: lambda q, *a, **kw: jnp.full(q.shape, marks[name], q.dtype)  # noqa: E731  (widths equal here)
  for name in ("cudnn", "splash"):
    monkeypatch.setitem(dispatch._LIBRARIES, name, dataclasses.replace(dispatch._LIBRARIES[name],
                                                                       attention=marked(name)))
  monkeypatch.setattr(dispatch.pallas, "attention", marked("pallas"))
  monkeypatch.setattr(dispatch.pallas, "attention_from_lse", marked("pallas_reuse"))
  monkeypatch.setattr(dispatch.tuning, "default_backend", lambda: "triton")
  monkeypatch.setattr(dispatch.pallas, "per_device", lambda kernel, *args: kernel(*args))
  _as_gpu(monkeypatch, "9.0")  # an H100
  bf16, f32 = jnp.ones((1, 16, 2, 16), jnp.bfloat16), jnp.ones((1, 16, 2, 16), jnp.float32)
  seg = jnp.ones((1, 16), jnp.int32)
  lse = jnp.zeros((1, 2, 16), jnp.float32)
  ops = dispatch.get_attention("auto")
  for platform, want, want_f32 in (("gpu", "cudnn", "pallas"), ("tpu", "splash", "splash")):
    monkeypatch.setattr(dispatch.tuning, "platform", lambda p=platform: p)
    with dispatch.documents_known(1):
      assert float(ops.attention(bf16, bf16, bf16, seg, seg)[0, 0, 0, 0]) == marks[want], platform
      assert float(ops.attention_from_lse(bf16, bf16, None, bf16, seg, seg, scale=0.25)[0, 0, 0, 0]) == marks[want]
      assert float(ops.attention_from_lse(bf16, bf16, lse, bf16, seg, seg, scale=0.25)[0, 0, 0, 0]) == \
        marks["pallas_reuse"]  # a source that handed on its LSE ran jaxshare's kernel: its reuse kernel follows
      assert float(ops.attention(f32, f32, f32, seg, seg)[0, 0, 0, 0]) == marks[want_f32], platform
  monkeypatch.setattr(dispatch.tuning, "platform", lambda: "gpu")  # a V100, or a ROCm GPU: no cuDNN flash attention
  _as_gpu(monkeypatch, None)
  with dispatch.documents_known(1):
    assert float(ops.attention(bf16, bf16, bf16, seg, seg)[0, 0, 0, 0]) == marks["pallas"]
    assert float(ops.attention_from_lse(bf16, bf16, None, bf16, seg, seg, scale=0.25)[0, 0, 0, 0]) == marks["pallas"]
  monkeypatch.setattr(dispatch.tuning, "platform", lambda: "cpu")
  monkeypatch.setattr(dispatch.tuning, "default_backend", lambda: "interpret")
  np.testing.assert_allclose(ops.attention(bf16, bf16, bf16, seg, seg).astype(jnp.float32),
                             reference.attention(bf16, bf16, bf16, seg, seg).astype(jnp.float32), atol=1e-2)


def test_documents_fit_counts_each_rows_documents():
  seg = _segments([[4, 4, 8], [16]])
  np.testing.assert_array_equal(reference.documents_per_row(seg), [3, 1])
  assert bool(reference.documents_fit(seg, 3)) and not bool(reference.documents_fit(seg, 2))
  assert bool(reference.documents_fit(_segments([[1] * 16, [16]]), 16))


def test_a_batch_with_more_documents_than_the_packed_layout_holds_runs_the_fallback(monkeypatch):
  """cuDNN's packed layout holds M documents per row (cudnn.MAX_DOCUMENTS; here M = 2): a batch with a row of more
  runs the fallback kernel, decided on device under jit, and both give the reference's values and gradients."""
  monkeypatch.setattr(cudnn.cudnn_attention, "dot_product_attention", _xla_stand_in)
  monkeypatch.setattr(dispatch.tuning, "platform", lambda: "gpu")
  library = dispatch._Library("cudnn", cudnn.attention, cudnn.unsupported, "gpu", max_documents=lambda _: 2)
  keys = jax.random.split(jax.random.key(3), 4)
  q, k, v = (jax.random.normal(key, (2, 16, 4, 16), jnp.bfloat16) for key in keys[:3])
  w = jax.random.normal(keys[3], (2, 16, 4, 16))
  marked = lambda *a, **kw: jnp.full(a[0].shape, 7.0, a[0].dtype)  # noqa: E731  (which branch ran)
  for rows, fits in (([[6, 10], [16]], True), ([[6, 10], [4, 4, 8]], False)):
    seg = _segments(rows)
    out = jax.jit(lambda q, k, v: dispatch._library_or(library, marked)(q, k, v, seg, seg))(q, k, v)
    assert bool(jnp.all(out == 7.0)) != fits, rows

    def loss(fn, q, k, v):
      return jnp.sum(fn(q, k, v, seg, seg).astype(jnp.float32) * w)
    call = dispatch._library_or(library, reference.attention)
    got = jax.jit(jax.value_and_grad(lambda *a: loss(call, *a), argnums=(0, 1, 2)))(q, k, v)
    want = jax.value_and_grad(lambda *a: loss(reference.attention, *a), argnums=(0, 1, 2))(q, k, v)
    for g, r in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
      np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(r, np.float32),
                                 atol=3e-2 * float(jnp.abs(r.astype(jnp.float32)).max()))


# Every attention role in a bf16 model: dense, K/V consumers (CLA2), probability reuse as attention over the source's
# Q and K (UniAttn with compensation; SA with a window), and LISA_plus's float32 features falling back.
@pytest.mark.parametrize("name", ["dense", "cla2", "uniattn", "mistral_window+sa", "bf16_lisa_plus"])
def test_model_with_cudnn_equals_xla(stand_in, name):
  """The stand-in for cuDNN, the interpret-mode Pallas kernels for the fallbacks (no GPU here)."""
  assert_model_equals_xla(name, "cudnn", "model.dtype=bfloat16")


def test_the_train_step_checks_documents_once_per_micro_batch(stand_in, batches):
  """``attention.impl=cudnn`` in the train step: one ``lax.switch`` per micro-batch around its forward and backward
  (cuDNN without the packed layout when every row is one document, cuDNN's packed layout for up to MAX_DOCUMENTS,
  else jaxshare's kernels alone with the LSE handed on), none per attention call, and xla's loss and gradient norm
  in all three cases (a UniAttn model: producers, probability reuse and plain layers)."""
  from jaxshare import parallel
  from jaxshare.config import MeshConfig
  from jaxshare.parallel import shard_batch
  from jaxshare.train.loop import jit_train_step
  from jaxshare.train.state import init_state, setup_training
  from jaxshare.train.step import Objective

  b, t = batches[0].segment_ids.shape
  rows = {"one": np.ones(t, np.int32), "packed": np.arange(t, dtype=np.int32) // 5 + 1,  # 7 documents
          "many": np.arange(t, dtype=np.int32) + 1}  # one-token documents, more than MAX_DOCUMENTS
  assert t > cudnn.MAX_DOCUMENTS >= 7
  cases = {name: batches[0].replace(segment_ids=np.broadcast_to(row, (b, t)).copy()) for name, row in rows.items()}
  mesh = parallel.make_mesh(MeshConfig(), jax.devices()[:1])
  results = {}
  for impl in ("cudnn", "xla"):
    setup = setup_training(tiny_config("schedule.kind=uniattn", "schedule.uniattn.block_size=2",
                                       "model.dtype=bfloat16", f"attention.impl={impl}"), mesh)
    step = jit_train_step(setup, Objective(), None)
    with jax.set_mesh(setup.mesh):
      state = init_state(setup)
      if impl == "cudnn":
        jaxpr = str(jax.make_jaxpr(step)(state, shard_batch(setup.batch_sharding, cases["one"]), None))
        assert jaxpr.count("cond[") == 1, "one documents check per micro-batch, none per attention call"
      results[impl] = {name: jax.device_get(step(init_state(setup), shard_batch(setup.batch_sharding, batch), None)[1])
                       for name, batch in cases.items()}
  for name in cases:
    for metric in ("loss", "grad_norm"):
      np.testing.assert_allclose(float(results["cudnn"][name][metric]), float(results["xla"][name][metric]),
                                 rtol=2e-2, err_msg=f"{name} {metric}")
