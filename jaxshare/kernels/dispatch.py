"""``attention.impl`` dispatch: the attention computations of a layer, by implementation and platform."""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import logging
from typing import Callable

import jax
import jax.numpy as jnp

from jaxshare.config import ConfigError
from jaxshare.config.choices import AttentionImpl, ContextStrategy, parse
from jaxshare import context
from jaxshare.kernels import (cudnn, decode, flash, flash_decode, local_queries, pallas, reference, ring, routes,
                              splash, tuning, xla)
from jaxshare.kernels.recompute import recomputed
from jaxshare.kernels.routes import Role

log = logging.getLogger(__name__)

@dataclasses.dataclass(frozen=True)
class AttentionOps:
  """Every attention computation a layer may run: the fused ones, chosen by ``attention.impl``, and the
  materialised ones (the same under every implementation: no kernel hands on ``[B, H, T, S]`` probabilities), so that
  a layer calls nothing else.

  Attributes:
    attention: softmax attention, the contract of :func:`jaxshare.kernels.reference.attention`.
    attention_from_lse: probability reuse, the contract of :func:`jaxshare.kernels.reference.attention_from_lse`.
    decode_attention: a decode step's attention over the cache and the new rows, the contract of
      :func:`jaxshare.kernels.decode.attention` (the Pallas decode kernel for decode steps under ``pallas*``, and
      under ``auto`` on GPU/TPU; a prefill runs in XLA).
    ring: under context parallelism the keys stay sharded along the sequence and attention runs round the ring
      (:mod:`jaxshare.kernels.ring`); else they arrive gathered.
  """

  attention: Callable
  attention_from_lse: Callable
  decode_attention: Callable = decode.attention
  ring: bool = False

  # Materialised scores: logits [B, H, T, S] float32, probabilities applied to V in float32.
  scores = staticmethod(reference.scores)
  masked_softmax = staticmethod(reference.masked_softmax)
  apply_probs = staticmethod(reference.apply_probs)
  decode_scores = staticmethod(decode.scores)
  decode_apply_probs = staticmethod(decode.apply_probs)

  @staticmethod
  def logits_attention(logits: jax.Array, v: jax.Array, segment_ids: jax.Array, *, window: int, dtype
                       ) -> tuple[jax.Array, jax.Array]:
    """Causal attention of materialised ``[B, H, T, S]`` float32 logits (unmasked; within-document, ``window``
    keys back when nonzero) applied to ``v [B, S, G, d]``.

    Returns:
      ``([B, T, H, d] in dtype, the masked probabilities [B, H, T, S] float32)``.
    """
    probs, _ = reference.masked_softmax(logits, reference.attention_mask(segment_ids, segment_ids, True, window))
    return reference.apply_probs(probs, v, dtype), probs


def _recomputed_reuse(q, k, lse, v, q_segment_ids, kv_segment_ids, *, q_offset=0, **kwargs):
  """XLA probability reuse recomputed in the backward pass (:func:`~jaxshare.kernels.recompute.recomputed`):
  nothing ``[B, H, T, S]`` is kept for it."""
  return recomputed(lambda q, k, lse, v, q_seg, kv_seg, offset: reference.attention_from_lse(
    q, k, lse, v, q_seg, kv_seg, q_offset=offset, **kwargs))(q, k, lse, v, q_segment_ids, kv_segment_ids,
                                                             jnp.asarray(q_offset, jnp.int32))


_XLA = AttentionOps(xla.attention, _recomputed_reuse)
_REFERENCE = AttentionOps(reference.attention, _recomputed_reuse)
_warned: set[str] = set()
# The most documents a row of the batch being traced holds, as its caller bounded it (None: unknown, each call
# decides on device). See documents_known.
_DOCUMENTS: contextvars.ContextVar[int | None] = contextvars.ContextVar("documents", default=None)
# Why a kernel cannot run a contract's arguments on a backend (None: it can).
_QKV = lambda args, backend: tuning.unsupported(*args[:3], backend=backend)  # noqa: E731
_REUSE_QKV = lambda args, backend: tuning.unsupported(args[0], args[1], args[3], backend=backend)  # noqa: E731
_DECODE_QKV = lambda args, backend: flash_decode.unsupported(args[0], args[1][0], args[2][0],  # noqa: E731
                                                             backend=backend)
_NO_ACCELERATOR = "no GPU or TPU"


def get_attention(impl: str, context_strategy: str = "all_gather") -> AttentionOps:
  """The attention computations for ``impl`` (:func:`_get_attention`), which under context parallelism (a mesh
  with a ``context`` axis, :mod:`jaxshare.context`) attend each device's query chunks to the keys with a kernel that
  takes a query offset (:func:`_context_kernels`): to the gathered keys (``context_strategy=all_gather``,
  :mod:`~jaxshare.kernels.local_queries`) or block by block round the ring (``ring``, :mod:`~jaxshare.kernels.ring`).

  Raises:
    ValueError: unknown implementation or strategy name.
  """
  ops = _get_attention(impl)
  local = functools.partial(_context_kernels, parse(AttentionImpl, impl, "attention.impl"))
  on_ring = parse(ContextStrategy, context_strategy, "attention.context_strategy") == ContextStrategy.RING

  def attention(q, k, v, q_segment_ids, kv_segment_ids, **kwargs):
    if context.active():
      forward, _, backward = local(q.dtype)
      if on_ring:
        return ring.attention(forward, q, k, v, kv_segment_ids, backward=backward, **kwargs)
      return local_queries.attention(forward, q, k, v, kv_segment_ids, **kwargs)
    return ops.attention(q, k, v, q_segment_ids, kv_segment_ids, **kwargs)

  def attention_from_lse(q, k, lse, v, q_segment_ids, kv_segment_ids, **kwargs):
    if context.active():
      if lse is None:  # the source ran a library kernel that hands on no LSE: impossible here, it ran ours
        raise ValueError("probability reuse under context parallelism needs its source's log-sum-exp")
      _, reuse, backward = local(q.dtype)
      if on_ring:
        return ring.attention_from_lse(reuse, q, k, lse, v, kv_segment_ids, backward=backward, **kwargs)
      return local_queries.attention_from_lse(reuse, q, k, lse, v, kv_segment_ids, **kwargs)
    return ops.attention_from_lse(q, k, lse, v, q_segment_ids, kv_segment_ids, **kwargs)

  return dataclasses.replace(ops, attention=attention, attention_from_lse=attention_from_lse, ring=on_ring)


# Why a library kernel does not attend a context-parallel device's queries, by implementation.
_CONTEXT_FALLBACK = {
  "cudnn": "cuDNN's causal mask (jax 0.10) aligns queries and keys at the start and takes no query offset, so it "
           "cannot attend a sequence shard's queries to the gathered keys, nor a query chunk to a key chunk of the "
           "ring by the chunks' offset",
  "splash": "splash attention's mask is static per query shard and cannot follow the load-balanced layout's "
            "per-device offsets",
}


def _context_kernels(impl: str, dtype) -> tuple[Callable, Callable, Callable]:
  """``(attention, attention_from_lse, attention_backward)`` run per device and query chunk under context
  parallelism, computing in ``dtype``: kernels of the reference contract that take ``q_offset``, and the backward
  pass alone of the first (:func:`jaxshare.kernels.xla.attention_backward`), which the ring runs per chunk pair.
  jaxshare's Pallas kernels on GPU/TPU (the libraries fall back to them, with one warning naming why; ``auto``: the
  context-parallel row of :data:`~jaxshare.kernels.routes.ROUTES`), XLA on CPU and where the kernels refuse the
  shapes.

  Raises:
    ConfigError: ``pallas`` (or a library) on a platform without its kernels.
  """
  if impl == "auto":
    row = routes.route(tuning.platform(), Role.CONTEXT, dtype)
    impl = {AttentionImpl.PALLAS: "auto", AttentionImpl.XLA: "xla"}[row.impl]
    if impl == "auto":
      _warn_once(f"attention.impl=auto under context parallelism runs {row.runs}: {row.why}")
  if impl in ("xla", "reference"):
    return (xla.attention if impl == "xla" else reference.attention), _recomputed_reuse, xla.attention_backward
  library = impl.removesuffix("_interpret")
  if library in _CONTEXT_FALLBACK:
    _warn_once(f"attention.impl={impl}: {library} not used under context parallelism ({_CONTEXT_FALLBACK[library]}); "
               "jaxshare's kernels run")
  if impl.endswith("_interpret"):
    return (functools.partial(flash.attention, backend="interpret"),
            functools.partial(flash.attention_from_lse, backend="interpret"),
            functools.partial(flash.attention_backward, backend="interpret"))
  if impl == "auto":
    return (_auto(flash.attention, xla.attention, _QKV), _auto(flash.attention_from_lse, _recomputed_reuse,
                                                                _REUSE_QKV),
            _auto(flash.attention_backward, xla.attention_backward, _QKV))
  return (_require_accelerator(flash.attention, _QKV), _require_accelerator(flash.attention_from_lse, _REUSE_QKV),
          _require_accelerator(flash.attention_backward, _QKV))


def _get_attention(impl: str) -> AttentionOps:
  """The attention computations for ``impl``.

  ``xla``: FlashAttention-style backward in XLA; ``reference``: plain autodiff (the numerical source of truth);
  ``pallas``: the fused kernels for the platform being compiled for (Mosaic on TPU, Triton on GPU; inside
  ``shard_map`` under a mesh); ``pallas_interpret``: the same kernels in Pallas interpret mode (any platform, for
  tests on CPU); ``splash``: jax's splash attention kernel on TPU for every softmax role, probability reuse
  included (attention over the source's Q and K, see :mod:`jaxshare.kernels.splash`), the Pallas decode kernel for
  decode steps; ``splash_interpret``: the same in interpret mode; ``cudnn``: cuDNN's fused attention on GPU likewise
  (:mod:`jaxshare.kernels.cudnn`); ``auto``: each call as its row of :data:`~jaxshare.kernels.routes.ROUTES` says
  (splash on TPU and cuDNN on GPU where they take the arguments, else ``pallas`` for the shapes it supports, else
  ``xla``, with one warning naming the reason). A library implementation runs jaxshare's kernels, with one warning,
  for arguments the library refuses. The platform is resolved when the model is traced, so a TPU topology
  mesh on a CPU host compiles the Mosaic kernels.

  Raises:
    ValueError: unknown implementation name. When called, the ops raise :class:`ConfigError` where the run compiles
      for another platform than ``pallas``, ``splash`` or ``cudnn`` need.
  """
  impl = parse(AttentionImpl, impl, "attention.impl")
  if impl == "xla":
    return _XLA
  if impl == "reference":
    return _REFERENCE
  if impl == "pallas_interpret":
    return AttentionOps(functools.partial(pallas.attention, backend="interpret"),
                        functools.partial(pallas.attention_from_lse, backend="interpret"),
                        functools.partial(pallas.decode_attention, backend="interpret"))
  if impl == "pallas":
    return AttentionOps(_require_accelerator(pallas.attention, _QKV),
                        _require_accelerator(pallas.attention_from_lse, _REUSE_QKV),
                        _require_accelerator(pallas.decode_attention, _DECODE_QKV))
  if impl in _LIBRARIES:  # jaxshare's kernels for what the library cannot run (LISA_plus's float32 features)
    library = _LIBRARIES[impl]
    own = _get_attention("pallas_interpret" if library.interpret else "pallas")
    return AttentionOps(_library_or(library, own.attention),
                        _library_reuse_or(library, own.attention, own.attention_from_lse),
                        own.decode_attention)
  return _routed()


def _routed() -> AttentionOps:
  """``attention.impl=auto``: every call runs the implementation of its row of
  :data:`~jaxshare.kernels.routes.ROUTES` (platform, role, compute dtype), chosen when it is traced."""
  own = AttentionOps(_auto(pallas.attention, xla.attention, _QKV),
                     _auto(pallas.attention_from_lse, _recomputed_reuse, _REUSE_QKV),
                     _auto(pallas.decode_attention, decode.attention, _DECODE_QKV))
  ops = {AttentionImpl.PALLAS: own, AttentionImpl.XLA: _XLA}
  for impl in {row.impl for row in routes.ROUTES} - set(ops):  # the library kernels
    library = _LIBRARIES[impl]
    ops[impl] = AttentionOps(_library_or(library, own.attention),
                             _library_reuse_or(library, own.attention, own.attention_from_lse), own.decode_attention)

  def attention(q, k, v, q_segment_ids, kv_segment_ids, **kwargs):
    return ops[_route_of(q, k, v).impl].attention(q, k, v, q_segment_ids, kv_segment_ids, **kwargs)

  def attention_from_lse(q, k, lse, v, q_segment_ids, kv_segment_ids, **kwargs):
    chosen = ops[_route_of(q, k, v, reuse=True).impl]
    if lse is None:  # the source ran a library kernel, which hands on no LSE: attention over its Q and K
      return chosen.attention(q, k, v, q_segment_ids, kv_segment_ids, **kwargs).astype(v.dtype)
    return chosen.attention_from_lse(q, k, lse, v, q_segment_ids, kv_segment_ids, **kwargs)

  def decode_attention(q, k, v, mask, **kwargs):
    return ops[routes.route(tuning.platform(), Role.DECODE, q.dtype).impl].decode_attention(q, k, v, mask, **kwargs)

  return AttentionOps(attention, attention_from_lse, decode_attention)


def _route_of(q, k, v, *, reuse: bool = False) -> routes.Route:
  """The row of a softmax call on the platform being compiled for: its role from the shapes
  (:func:`~jaxshare.kernels.routes.role_of`), or rows of more documents than the platform's library takes, where
  the caller bounded them (:func:`documents_known`)."""
  platform = tuning.platform()
  role = routes.role_of(q, k, v, reuse=reuse)
  library = library_for("auto", platform)
  bound = _DOCUMENTS.get()
  if library is not None and library.max_documents and bound is not None and bound > library.max_documents(platform):
    role = Role.DOCUMENTS
  return routes.route(platform, role, q.dtype)


@dataclasses.dataclass(frozen=True)
class _Library:
  """A library attention kernel: ``attention`` (the reference contract, ``(out, None)`` for ``return_lse``), the
  platform it compiles for (None: any, interpret mode) and why it refuses arguments (``unsupported``)."""

  impl: str
  attention: Callable
  unsupported: Callable
  platform: str | None
  elsewhere: str = ""  # what else to use off its platform, after "Use auto"
  # the most documents per row its kernel takes for a platform (``attention`` then takes ``max_documents``); None: any
  max_documents: Callable[..., int] | None = None
  dtypes: tuple | None = None  # the compute dtypes it takes (None: any)
  device_unsupported: Callable[[], str | None] | None = None  # why its platform's device cannot run it (None: can)

  def unsupported_dtype(self, dtype) -> bool:
    return self.dtypes is not None and jnp.dtype(dtype) not in self.dtypes

  @property
  def interpret(self) -> bool:
    return self.platform is None


_LIBRARIES = {
  "splash": _Library("splash", splash.attention, splash.unsupported, "tpu",
                     ", or splash_interpret to run the kernel in interpret mode"),
  "splash_interpret": _Library("splash_interpret", functools.partial(splash.attention, interpret=True),
                               splash.unsupported, None),
  "cudnn": _Library("cudnn", cudnn.attention, cudnn.unsupported, "gpu", max_documents=cudnn.max_documents,
                    device_unsupported=cudnn.device_unsupported,
                    dtypes=cudnn.DTYPES),
}


def library_for(impl: str, platform: str) -> _Library | None:
  """The library kernel ``attention.impl=impl`` runs when compiling for ``platform`` (``gpu``, ``tpu``, ``cpu``), or
  None where it runs jaxshare's kernels or XLA (``auto``: what its rows run for own scores in bf16)."""
  if impl != "auto":
    return _LIBRARIES.get(impl)
  if platform not in routes.PLATFORMS:
    return None
  return _LIBRARIES.get(routes.route(platform, Role.OWN, jnp.bfloat16).impl)


def document_bounds(impl: str, dtype: str, platform: str | None = None) -> tuple[int, ...] | None:
  """The bounds on documents per row for which ``attention.impl=impl``'s library kernel, computing in ``dtype``
  (``model.dtype``) for ``platform`` (default: the one being compiled for), is worth tracing apart (cuDNN in bf16
  on Hopper: ``(1, 16)``: one document, no packed layout; up to 16, packed; before Hopper ``(1,)``), or None where
  the documents do not change the kernel (no limit, or a dtype the library refuses, whose calls all fall back). A
  caller traces its computation once per bound and once past the last (:func:`documents_known`)."""
  platform = tuning.platform() if platform is None else platform
  library = library_for(impl, platform)
  if library is None or library.max_documents is None or library.unsupported_dtype(dtype):
    return None
  if library.platform == platform and library.device_unsupported and library.device_unsupported():
    return None  # every call falls back
  return tuple(sorted({1, library.max_documents(platform)}))


@contextlib.contextmanager
def documents_known(bound: int | None):
  """Within this context the caller guarantees that no row of the batch holds more than ``bound`` documents, and
  attention traced for a library with a document limit (cuDNN's packed layout) runs the library kernel alone, sized
  to ``bound``, or, past the library's limit, jaxshare's kernels alone (producers then hand on the LSE and
  probability reuse runs jaxshare's reuse kernel: the computation of ``attention.impl=pallas``), instead of choosing
  per call with ``lax.cond``. A caller that checks the batch once and traces its whole computation under each bound
  (:func:`jaxshare.train.step.make_train_step`) keeps the per-call conds' cost out of the backward (5-17 GiB of
  temporaries in the 1.2B step)."""
  token = _DOCUMENTS.set(bound)
  try:
    yield
  finally:
    _DOCUMENTS.reset(token)


def knowing(bound: int | None, fn: Callable) -> Callable:
  """``fn`` traced under :func:`documents_known` ``(bound)`` (None: each attention call decides on device)."""
  def call(*args, **kwargs):
    with documents_known(bound):
      return fn(*args, **kwargs)
  return call


def _library_or(library: _Library, fallback: Callable) -> Callable:
  """The library kernel per device; for arguments it refuses ``fallback`` (one warning naming why), and for
  batches whose documents it cannot take (more per row than ``library.max_documents``) ``fallback``: decided on
  device by ``lax.cond``, the fallback then returning no LSE, so that the caller sees the library's ``(out, None)``
  either way; or by the caller (:func:`documents_known`), the fallback then handing on its LSE.

  Raises:
    ConfigError: the run compiles for another platform than the library's."""
  def call(q, k, v, q_segment_ids, kv_segment_ids, *, causal=True, scale=None, window=0, return_lse=False):
    if library.platform and tuning.platform() != library.platform:
      raise ConfigError(f"attention.impl={library.impl} runs on {library.platform.upper()}s; this run compiles for "
                        f"{tuning.platform()}. Use auto{library.elsewhere}")
    if reason := (library.platform and library.device_unsupported and library.device_unsupported()) or \
        library.unsupported(q, k, v):
      _warn_once(f"attention.impl: {library.impl} not used ({reason}); falling back")
      return fallback(
        q, k, v, q_segment_ids, kv_segment_ids, causal=causal, scale=scale, window=window, return_lse=return_lse)
    kernel = functools.partial(library.attention, causal=causal, scale=scale, window=window)
    args = (q, k, v, q_segment_ids, kv_segment_ids)
    limit = library.max_documents(tuning.platform()) if library.max_documents else None
    bound = _DOCUMENTS.get()
    if limit is None:
      out = pallas.per_device(kernel, *args)
    elif bound is None:
      fit = reference.documents_fit(q_segment_ids, limit) & reference.documents_fit(kv_segment_ids, limit)
      out = jax.lax.cond(fit, lambda: pallas.per_device(functools.partial(kernel, max_documents=limit), *args),
                         lambda: fallback(*args, causal=causal, scale=scale, window=window).astype(q.dtype))
    elif bound > limit:  # jaxshare's kernels throughout, the LSE handed on
      return fallback(*args, causal=causal, scale=scale, window=window, return_lse=return_lse)
    else:
      out = pallas.per_device(functools.partial(kernel, max_documents=bound), *args)
    return (out, None) if return_lse else out
  return call


def _library_reuse_or(library: _Library, attention: Callable, with_lse: Callable) -> Callable:
  """Probability reuse as attention over the source's Q and K (the library kernel, or ``attention`` where it refuses
  the arguments or the batch's documents: jaxshare's tiled kernel, never ``[B, H, T, S]``) when the source handed on
  no LSE (it ran the library kernel, or a per-call choice did); ``with_lse`` when it did (it fell back to a kernel
  that returns one, whose reuse sends the LSE its gradient)."""
  attention = _library_or(library, attention)

  def call(q, k, lse, v, q_segment_ids, kv_segment_ids, *, scale, causal=True, window=0):
    if lse is None:
      return attention(q, k, v, q_segment_ids, kv_segment_ids, causal=causal, scale=scale,
                       window=window).astype(v.dtype)
    return with_lse(q, k, lse, v, q_segment_ids, kv_segment_ids, scale=scale, causal=causal, window=window)
  return call


def _warn_once(message: str) -> None:
  """Log ``message`` as a warning the first time it is given in this process."""
  if message not in _warned:
    _warned.add(message)
    log.warning("%s", message)


def _reason_not_to_run(args: tuple, check: Callable) -> str | None:
  """Why the kernels cannot run these arguments here: no accelerator, or what ``check`` (one of ``_QKV``,
  ``_REUSE_QKV``, ``_DECODE_QKV``) refuses."""
  backend = tuning.default_backend()
  if backend == "interpret":
    return _NO_ACCELERATOR
  return check(args, backend)


def _require_accelerator(kernel: Callable, check: Callable) -> Callable:
  @functools.wraps(kernel)
  def call(*args, **kwargs):
    if reason := _reason_not_to_run(args, check):
      # a ConfigError (a ValueError): the config is valid, but not for this host or these shapes
      raise ConfigError(f"attention.impl=pallas cannot run here: {reason}. Use pallas_interpret to run the kernels "
                       "in interpret mode, or auto to fall back to xla")
    return kernel(*args, **kwargs)
  return call


def _auto(kernel: Callable, fallback: Callable, check: Callable) -> Callable:
  """``kernel`` on GPU/TPU for the shapes it supports; else ``fallback`` (one warning per reason on GPU/TPU)."""
  @functools.wraps(kernel)
  def call(*args, **kwargs):
    reason = _reason_not_to_run(args, check)
    if reason is None:
      return kernel(*args, **kwargs)
    if reason != _NO_ACCELERATOR:
      _warn_once(f"attention.impl=auto: Pallas kernel not used ({reason}); falling back to xla")
    return fallback(*args, **kwargs)
  return call
