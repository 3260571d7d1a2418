"""cuDNN flash attention (what MaxText runs on GPUs) behind the attention contract.

jax's cuDNN fused attention takes ``[B, T, N, h]`` bf16/fp16 Q, K, V with fewer K/V heads (GQA without repeating K/V),
causal and sliding-window masks, and packed documents in its *packed layout*: per row, the offset and length of each
document (``q_offsets``/``q_seqlen``, ``[B, M+1]``/``[B, M]``, padded with -1; Hopper and later). The public
``jax.nn.dot_product_attention`` takes only one length per row, so packed rows go through
``jax._src.cudnn.fused_attention_stablehlo.dot_product_attention``, as the jax docs' own packed-layout example does.
M, the most documents a row may hold, is static, and cuDNN sizes its work by it: it treats the B·M documents as a
batch of length-T sequences, so its backward's fp32 workspace is B·M·N·T·d·4 bytes (M = T asked 4.1 TiB at
T = 16384 on an H200). M is therefore at most :data:`MAX_DOCUMENTS` (MaxText's ``max_segments_per_seq``), and a
batch with a row of more documents runs jaxshare's own kernel instead (the caller checks, on device:
:func:`jaxshare.kernels.dispatch.documents_known`). With M = 1 (every row one document) no packed layout is built:
the packed layout took 1.2-1.4x the time of plain causal cuDNN attention at T = 4096, d = 128 on an H200. Before
Hopper there is no packed layout: M is 1 (:func:`max_documents`).

Probability reuse runs as attention with the source layer's scores, as in :mod:`jaxshare.kernels.splash`:
``softmax(s·q_src k_srcᵀ) V_consumer`` (SA Alg. 1, UniAttn Eq. 3), the library's backward giving the source's Q and K
and the consumer's V their gradients; no LSE is handed on. A LISA_plus chain read in bf16 (``attention.chain_dtype=
compute``) is attention with Q/K wider than V, which jax runs through cuDNN's "MLA" path on Hopper (cuDNN >= 9.10),
its features zero-padded to a multiple of 8.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax._src.cudnn import fused_attention_stablehlo as cudnn_attention

from jaxshare.kernels import reference

DTYPES = (jnp.bfloat16, jnp.float16)
MAX_DOCUMENTS = 16  # M: documents per row in cuDNN's packed layout (see the module docstring)
MAX_WIDTH = 128  # head widths cuDNN takes on every GPU jaxshare targets (Hopper: 256; Ampere: 128)
PACKED_CAPABILITY = "9.0"  # jax: "Packed layout requires a GPU with at least Hopper architecture" (and Q/K wider than V)
MLA_MAX_WIDTH = 256  # Q/K widths cuDNN takes on Hopper
FLASH_CAPABILITY = "8.0"  # cuDNN's fused flash attention: Ampere and later


def max_documents(platform: str) -> int:
  """The most documents per row cuDNN takes when compiling for ``platform``: :data:`MAX_DOCUMENTS` where the packed
  layout runs (compute capability 9.0 and later, as jax's own check answers: the local GPU's, or a compile-only
  target's, see :func:`jaxshare.aot.topology.topology_devices`), else 1 (an A100 runs cuDNN on rows of one document and
  jaxshare's kernels on packed rows). Off GPUs :data:`MAX_DOCUMENTS`: the caller refuses to run cuDNN there, or a test
  stands in for it."""
  if platform != "gpu":
    return MAX_DOCUMENTS
  return MAX_DOCUMENTS if cudnn_attention.check_compute_capability(PACKED_CAPABILITY) else 1


def device_unsupported() -> str | None:
  """Why cuDNN flash attention cannot run on the GPU being compiled for (jax's own checks: the local GPU's, or a
  compile-only target's), or None: it needs an NVIDIA GPU of compute capability 8.0 or later (jax does not check
  that before a compile fails) and the cuDNN library (absent beside a ROCm plugin)."""
  if not cudnn_attention.check_compute_capability(FLASH_CAPABILITY):
    return f"cuDNN flash attention needs an NVIDIA GPU of compute capability {FLASH_CAPABILITY} or later"
  return None if _cudnn_version() else "no cuDNN library"


def unsupported(q, k, v) -> str | None:
  """Why cuDNN cannot run ``q [B,T,H,e]``, ``k [B,S,Gk,e]``, ``v [B,S,Gv,d]`` (arrays or shape structs), or None.
  Widths: equal, multiples of 8 up to :data:`MAX_WIDTH`; or, where :func:`wide_queries` (Hopper), Q/K of any width up
  to :data:`MLA_MAX_WIDTH` (zero-padded to a multiple of 8) over V of a multiple of 8 (a LISA_plus chain's features)."""
  if q.dtype not in DTYPES:
    return f"cuDNN flash attention takes bfloat16 or float16, not {jnp.dtype(q.dtype).name}"
  e, d = q.shape[3], v.shape[3]
  if e != d and d % 8 == 0 and d <= MLA_MAX_WIDTH and _padded(e) <= MLA_MAX_WIDTH and wide_queries():
    return reference.self_attention_unsupported(q, k, v)
  if e != d or e > MAX_WIDTH or e % 8:
    return (f"head widths {e}/{d}: cuDNN takes equal Q/K and V widths, multiples of 8 up to {MAX_WIDTH} (Q/K up to "
            f"{MLA_MAX_WIDTH} over V of a multiple of 8 on Hopper with cuDNN >= 9.10)")
  return reference.self_attention_unsupported(q, k, v)


def wide_queries() -> bool:
  """Whether cuDNN takes Q/K wider than V here (jax's "MLA" path: compute capability 9.0 and cuDNN 9.10 or later, as
  jax's own checks answer for the local GPU or a compile-only target)."""
  return cudnn_attention.check_compute_capability(PACKED_CAPABILITY) and _cudnn_version() >= 91000


def _cudnn_version() -> int:
  """jax's answer for the cuDNN library's version (e.g. 92800), 0 without one (beside a ROCm plugin, say)."""
  try:
    return cudnn_attention.check_cudnn_version()
  except RuntimeError:
    return 0


def _padded(width: int) -> int:
  return -(-width // 8) * 8


def packing(segment_ids: jax.Array, max_segments: int) -> tuple[jax.Array, jax.Array]:
  """cuDNN's packed layout of contiguous documents: ``(lengths [B, M] int32, offsets [B, M+1] int32)``, each
  document's token count and first position in its row, -1 past the row's last document.

  Args:
    segment_ids: ``[B, T]`` int32; a document is a run of equal ids.
    max_segments: M, static; a row's documents beyond the M-th are dropped.
  """
  b, t = segment_ids.shape
  start = jnp.concatenate([jnp.ones((b, 1), bool), segment_ids[:, 1:] != segment_ids[:, :-1]], axis=1)
  document = jnp.cumsum(start, axis=1) - 1  # [B, T]: each token's document index in its row
  rows = jnp.arange(b)[:, None]
  lengths = jnp.zeros((b, max_segments), jnp.int32).at[rows, document].add(1, mode="drop")
  positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
  offsets = jnp.full((b, max_segments + 1), -1, jnp.int32).at[rows, jnp.where(start, document, max_segments + 1)].set(
    positions, mode="drop")
  return jnp.where(lengths > 0, lengths, -1), offsets


def attention(q: jax.Array, k: jax.Array, v: jax.Array, q_segment_ids: jax.Array, kv_segment_ids: jax.Array,
              *, causal: bool = True, scale: float | None = None, window: int = 0, return_lse: bool = False,
              max_documents: int = MAX_DOCUMENTS) -> jax.Array | tuple[jax.Array, None]:
  """Softmax attention by cuDNN; the contract of :func:`jaxshare.kernels.reference.attention` (``q [B,T,H,e]``,
  ``k [B,S,G,e]``, ``v [B,S,G,d]``, segment ids ``[B,T]`` int32 in contiguous runs; output ``[B,T,H,d]`` in q's
  dtype), except that ``return_lse`` returns ``(out, None)``: see the module docstring. Documents past a row's
  ``max_documents``-th are dropped (their output is undefined): callers check
  :func:`jaxshare.kernels.reference.documents_fit` first; with ``max_documents=1`` the segment ids are not read.
  Lowers only for a GPU (jax raises "cuDNN not found" without NVIDIA's library).

  Raises:
    ValueError: a shape or dtype :func:`unsupported` names.
  """
  if reason := unsupported(q, k, v):
    raise ValueError(f"cuDNN attention cannot run these arguments: {reason}")
  scale = q.shape[-1] ** -0.5 if scale is None else scale
  if pad := _padded(q.shape[-1]) - q.shape[-1]:  # zero features leave q kᵀ as it is
    widen = lambda x: jnp.pad(x, ((0, 0),) * 3 + ((0, pad),))  # noqa: E731
    q, k = widen(q), widen(k)
  k, v = reference.same_kv_heads(k, v, q.shape[2])
  kinds = cudnn_attention.MaskType
  if max_documents == 1:
    layout, mask = (None,) * 4, kinds.CAUSAL if causal else kinds.NO_MASK
  else:
    (q_lengths, q_offsets), (kv_lengths, kv_offsets) = (packing(q_segment_ids, max_documents),
                                                        packing(kv_segment_ids, max_documents))
    layout, mask = (q_lengths, kv_lengths, q_offsets, kv_offsets), kinds.PADDING_CAUSAL if causal else kinds.PADDING
  # cuDNN's window counts the query's own key, as attention.window does (Mistral: itself and window - 1 before)
  out = cudnn_attention.dot_product_attention(q, k, v, None, None, *layout, scale=scale, mask_type=mask,
                                              qkv_layout="BTNH", sliding_window_length=window or None)
  out = out.astype(q.dtype)
  return (out, None) if return_lse else out

