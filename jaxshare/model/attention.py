"""Self-attention of one layer under a sharing schedule.

A layer may own or borrow each of: its K/V (a producer's post-RoPE K/V: CLA, MLKV), its attention scores
(another layer's softmax probabilities: SA, UniAttn; or the previous layer's pre-softmax logits plus a low-rank
delta: LISA, LISA_plus, DS). What it owns is its :class:`~jaxshare.schedule.LayerRole`; the scores it hands on and
reads are :mod:`jaxshare.model.scores` states.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from flax import nnx, struct
from jax.ad_checkpoint import checkpoint_name

from jaxshare import context, parallel
from jaxshare.config.choices import Integrator, ScoreReuse, ScoreSharing
from jaxshare.kernels.dispatch import get_attention
from jaxshare.model import cache as kv_cache
from jaxshare.model import scores
from jaxshare.model.cache import StepContext
from jaxshare.model.layers import DenseGeneral
from jaxshare.model.remat import KEY_PROJ, OUT_PROJ, QUERY_PROJ, VALUE_PROJ
from jaxshare.model.rope import RopeScaling, apply_rope
from jaxshare.model.scores import LowRank, ScoreFeatures, ScoreState, ScoreTensors
from jaxshare.plan import ModelPlan
from jaxshare.schedule import LayerRole

KV = tuple[jax.Array | None, jax.Array]
# A decoding producer's K and V as (cache, new rows) blocks, heads-major (K None for score reusers).
DecodeKV = tuple[tuple[jax.Array, ...] | None, tuple[jax.Array, ...]]


_PROJ_NAMES = {"q": QUERY_PROJ, "k": KEY_PROJ, "v": VALUE_PROJ}


@struct.dataclass
class Prepared:
  """What a layer's attention reads that its superblock may compute outside the layer's checkpoint
  (:mod:`jaxshare.model.remat`): the parts other layers share, computed once for all their readers.

  Attributes:
    kv: the layer's ``(K, V)`` (``[B, S, G, d]``, K None for a producer that reuses scores): a consumer's producer's,
      or a producer's own when its readers share them; None: the layer projects its own.
    q: ``[B, T, H, d]`` rotated queries of a layer whose scores others reuse; None: the layer projects them.
    state: the score state the layer attends with: a probability reuser's source state, or a LISA layer's chain
      extended by its low-rank delta (None for a layer with its own scores).
  """

  kv: KV | None = None
  q: jax.Array | None = None
  state: ScoreState | None = None


@struct.dataclass
class Attended:
  """What an attention layer hands back in a forward pass.

  Attributes:
    y: ``[B, T, D]`` the attention output.
    kv: the layer's ``(K, V)`` (the producer's, for a consumer), for the K/V consumers of its superblock.
    handed: the score state later layers reuse (None when none does).
    used: the score state whose logits the layer used (None for a probability reuser: it uses its source's).
  """

  y: jax.Array
  kv: KV
  handed: ScoreState | None
  used: ScoreState | None


@dataclasses.dataclass(frozen=True)
class Decoded:
  """What a decode step of a layer, or of a run of layers, hands back.

  Attributes:
    y: ``[B, n, D]``: the attention output (:meth:`Attention.decode`) or the residual stream (a layer, a run).
    rows: the new cache rows, ``{name: [B, G, n, e]}`` (a run: ``{name: [length, B, G, n, e]}``).
    kv: the layer's K/V blocks for the consumers of its superblock (None from a run of several layers).
    handed: the score rows ``[B, H, n, S + n]`` float32 handed to later reusers (None when none reads them).
  """

  y: jax.Array
  rows: dict
  kv: DecodeKV | None
  handed: jax.Array | None


_BTH = ("activation_batch", "activation_length", "activation_heads", None)
_BTG = ("activation_batch", "activation_length", "activation_kv_heads", None)


def sum_aligner(num_heads: int, hidden: int, std: float, key: jax.Array, dtype) -> tuple[jax.Array, jax.Array]:
  """LISA's ffn aligner ``relu(z W_in) W_out`` (``z = [A_{n-1}; A_Δ]``, 2H -> hidden -> H) initialised to compute
  ``A_{n-1} + A_Δ`` exactly, like LISA_plus: units ``h`` and ``H + h`` read ``±(A_{n-1,h} + A_{Δ,h})`` and are
  written back with ``±1`` (``relu(s) − relu(−s) = s``); the other ``hidden − 2H`` units read random N(0, std²)
  weights and start with zero output weights, so they learn without moving the start.

  Returns:
    ``(W_in [2H, hidden], W_out [hidden, H])``.
  """
  eye = jnp.eye(num_heads)
  plus = jnp.concatenate([eye, eye])  # [2H, H]: A_{n-1,h} + A_delta,h
  w_in = jnp.concatenate([plus, -plus, std * jax.random.normal(key, (2 * num_heads, hidden - 2 * num_heads))], 1)
  w_out = jnp.concatenate([eye, -eye, jnp.zeros((hidden - 2 * num_heads, num_heads))])
  return w_in.astype(dtype), w_out.astype(dtype)


class Attention(nnx.Module):
  """Attention of one layer in the role the schedule gives it.

  Every attention computation runs through one :class:`~jaxshare.kernels.dispatch.AttentionOps`, chosen from the
  plan's ``attention.impl``; what a reusing layer reads is a :mod:`~jaxshare.model.scores` state, which knows how to
  attend (``reuse`` its probabilities; ``extend`` a LISA chain by a layer's delta and ``attend`` over its logits).

  Args:
    plan: the compiled model; its ``model`` and ``attention`` groups are read:
    role: what the layer owns and reads (:class:`~jaxshare.schedule.LayerRole`).
    attention.impl: the :class:`~jaxshare.kernels.dispatch.AttentionOps` the layer runs.
    attention.score_sharing: ``recompute`` (hand on :class:`~jaxshare.model.scores.ScoreFeatures`: probability reusers
      recompute ``exp(QKᵀ·s − lse)`` under ``jax.checkpoint``, LISA_plus/DS chains attend over concatenated
      features; nothing ``[B,H,T,T]`` is kept per reusing layer) or ``materialize`` (hand on the probabilities or
      logits). Both give the same numbers; with recompute full LISA's aligner chains hand on an
      :class:`~jaxshare.model.scores.AlignerChain` and attend in query chunks.
    attention.chain_dtype: what a LISA_plus/DS chain's attention reads its float32 features as: ``float32`` (its logits
      equal the materialised sum to float32 rounding) or ``compute`` (``cfg.dtype``, rounded as a bf16 layer's own
      Q and K are, so that library kernels that take bf16/fp16 alone run the chain: cuDNN on Hopper).

  Parameters (absent when the role does not need them): ``q_proj [D,H,d]``, ``k_proj``/``v_proj [D,G,d]``,
  ``o_proj [H,d,D]``; LISA ``q_lr [D,H,r]``, ``k_lr [D,G,r]``, aligner ``align_in [2H,hidden]`` +
  ``align_out [hidden,H]`` (ffn) or ``align [2H,H]`` (linear, initialised ``[I; I]``). With ``keep_qk`` a LISA layer
  also keeps ``q_proj``/``k_proj``, marked not trainable.
  """

  def __init__(self, plan: ModelPlan, role: LayerRole, *, rngs: nnx.Rngs):
    cfg, settings = plan.model, plan.attention
    D, H, d, g = cfg.d_model, cfg.num_heads, cfg.resolved_head_dim, role.num_kv_heads
    dtype, pdtype = jnp.dtype(cfg.dtype), jnp.dtype(cfg.param_dtype)
    qkv_bias, out_bias = cfg.features.qkv_biases, cfg.features.dense_biases
    std, out_std = cfg.init_std, cfg.init_std / math.sqrt(2 * cfg.num_layers)
    self.role, self.head_dim, self.dtype = role, d, dtype
    self.theta, self.rotary_dim, self.rope_scaling = cfg.rope_theta, int(d * cfg.rotary_pct), RopeScaling.of(cfg)
    self.recompute = settings.score_sharing == ScoreSharing.RECOMPUTE
    self.chain_dtype = dtype if settings.chain_dtype == "compute" else None
    self.window = cfg.sliding_window
    self.ops = get_attention(settings.impl, settings.context_strategy)

    def proj(heads: int, axes: str, width: int, trainable: bool = True) -> DenseGeneral:
      return DenseGeneral("btd,dhk->bthk", (D, heads, width), ("embed", axes, "head_dim"), std=std,
                          bias_shape=(heads, width) if qkv_bias and width == d else None, bias_axes=(axes, "head_dim"),
                          dtype=dtype, param_dtype=pdtype, trainable=trainable, rngs=rngs)

    own = not role.tied_qkv  # head-wise sharing: W_q, W_k, W_v come from the model's head table
    full_qk = not role.score_reuse or role.keep_qk
    trained_qk = not role.score_reuse  # LISA's kept W_q/W_k serve NF prefill only
    self.q_proj = proj(H, "heads", d, trained_qk) if own and full_qk else None
    self.k_proj = proj(g, "kv_heads", d, trained_qk) if own and role.is_producer and full_qk else None
    self.v_proj = proj(g, "kv_heads", d) if own and role.is_producer else None
    self.o_proj = DenseGeneral("bthk,hkd->btd", (H, d, D), ("heads", "head_dim", "embed"), std=out_std,
                               bias_shape=(D,) if out_bias else None, bias_axes=("embed",), dtype=dtype,
                               param_dtype=pdtype, rngs=rngs)
    self.q_lr = proj(H, "heads", role.lisa_rank) if role.has_low_rank else None
    self.k_lr = proj(g, "kv_heads", role.lisa_rank) if role.has_low_rank else None
    ffn = sum_aligner(H, role.lisa_hidden, std, rngs.params(), pdtype) if role.integrator == Integrator.FFN else None
    self.align_in = nnx.Param(ffn[0], logical_axes=("heads", "mlp")) if ffn else None
    self.align_out = nnx.Param(ffn[1], logical_axes=("mlp", "heads")) if ffn else None
    # The linear integrator starts as LISA_plus too: A_{n-1} + A_delta.
    self.align = nnx.Param(jnp.concatenate([jnp.eye(H), jnp.eye(H)]).astype(pdtype), logical_axes=("heads", None)
                           ) if role.integrator == Integrator.LINEAR else None

  def _project(self, name: str, x: jax.Array, head_kernels: dict | None) -> jax.Array:
    if head_kernels is None:
      y = getattr(self, f"{name}_proj")(x)
    else:
      y = jnp.einsum("btd,dhk->bthk", x.astype(self.dtype), head_kernels[name].astype(self.dtype))
    return checkpoint_name(y, _PROJ_NAMES[name])

  def _kv(self, x: jax.Array, positions: jax.Array, head_kernels: dict | None) -> KV:
    """A producer's own K/V; under context parallelism gathered over the sequence shards
    (:func:`jaxshare.context.gather_keys`), which every reader of them then uses, unless the ring moves them."""
    k = None if self.role.score_reuse else self._k(x, positions, head_kernels)
    return k, self._gather(parallel.constrain(self._project("v", x, head_kernels), _BTG))

  def _k(self, x: jax.Array, positions: jax.Array, head_kernels: dict | None) -> jax.Array:
    return self._gather(parallel.constrain(self._rope(self._project("k", x, head_kernels), positions), _BTG))

  def source_qk(self, x: jax.Array, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
    """A layer's own rotated queries ``[B, T, H, d]`` and keys ``[B, S, G, d]`` from its normalised input ``x [B, T,
    D]``, as :meth:`prepare` and :meth:`__call__` compute them (what
    :class:`~jaxshare.model.source_projection.SourceProjection` differentiates)."""
    return self._q(x, positions, None), self._k(x, positions, None)

  def _gather(self, keys: jax.Array) -> jax.Array:
    """Keys read over the whole sequence: gathered under ``attention.context_strategy=all_gather``, left sharded
    along the sequence for the ring (:mod:`jaxshare.kernels.ring`)."""
    return keys if self.ops.ring else context.gather_keys(keys)

  def _q(self, x: jax.Array, positions: jax.Array, head_kernels: dict | None) -> jax.Array:
    return parallel.constrain(self._rope(self._project("q", x, head_kernels), positions), _BTH)

  def _rope(self, x: jax.Array, positions: jax.Array, rotary_dim: int | None = None) -> jax.Array:
    return apply_rope(x, positions, self.theta, self.rotary_dim if rotary_dim is None else rotary_dim,
                      self.rope_scaling)

  def _low_rank(self, x: jax.Array, positions: jax.Array) -> LowRank:
    q, k = self.q_lr(x), self.k_lr(x)
    if self.role.lisa_rope:
      rot = self.role.lisa_rank - self.role.lisa_rank % 2
      q, k = self._rope(q, positions, rot), self._rope(k, positions, rot)
    return q, k

  def _aligner_weights(self) -> tuple[jax.Array, ...]:
    """This layer's aligner weights in :func:`~jaxshare.model.scores.integrate`'s order (none for ``add``)."""
    if self.role.integrator == Integrator.LINEAR:
      return (self.align[...],)
    if self.role.integrator == Integrator.FFN:
      return (self.align_in[...], self.align_out[...])
    return ()

  def prepare(self, x: jax.Array, positions: jax.Array, kv_in: KV | None = None, score_in: ScoreState | None = None,
              slot: jax.Array | int = 0, head_kernels: dict | None = None, *, own_kv: bool = False,
              source_q: bool = False) -> Prepared:
    """What the layer reads from other layers, and with ``own_kv`` / ``source_q`` what other layers read from it.

    Args:
      x: ``[B, T, D]`` normalised input.
      positions: ``[B, T]`` int32 RoPE positions.
      kv_in: a K/V consumer's producer ``(K, V)`` (K None if the producer reuses scores).
      score_in: a probability reuser's source state, or a LISA layer's chain state (see
        :func:`~jaxshare.model.scores.chain_entry`).
      slot: LISA_plus in a features chain: the offset of this layer's feature slot; full LISA in an
        :class:`~jaxshare.model.scores.AlignerChain`: this layer's slot.
      head_kernels: head-wise sharing: this layer's gathered ``{"q", "k", "v"}`` kernels ``[D, H, d]``.
      own_kv: a producer computes its own K/V here (its readers share them), else in :meth:`__call__`.
      source_q: a layer with its own scores computes its queries here (its scores are reused), else in
        :meth:`__call__`.

    Raises:
      ValueError: a consumer without its producer's K/V, a score-reusing layer without its source's state.
    """
    role = self.role
    if not role.is_producer and kv_in is None:
      raise ValueError("a K/V consumer layer needs its producer's K/V")
    kv = kv_in if not role.is_producer else self._kv(x, positions, head_kernels) if own_kv else None
    q = self._q(x, positions, head_kernels) if source_q and not role.score_reuse else None
    if not role.score_reuse:
      return Prepared(kv, q, None)
    if score_in is None:
      raise ValueError("a score-reusing layer needs its source layer's score state")
    if role.score_reuse == ScoreReuse.PROBS:
      return Prepared(kv, None, score_in)
    delta = None
    if role.has_low_rank:  # its low-rank keys, like K, are read over the whole sequence
      q_lr, k_lr = self._low_rank(x, positions)
      delta = q_lr, self._gather(k_lr)
    return Prepared(kv, None, score_in.extend(delta, slot, role.integrator, self._aligner_weights()))

  def __call__(self, x: jax.Array, positions: jax.Array, segment_ids: jax.Array, prepared: Prepared,
               head_kernels: dict | None = None) -> Attended:
    """Attend.

    Args:
      x: ``[B, T, D]`` normalised input.
      positions: ``[B, T]`` int32 RoPE positions.
      segment_ids: ``[B, T]`` int32 packed-document ids (under context parallelism the whole sequence's, in order:
        :func:`jaxshare.context.gather_keys`).
      prepared: what :meth:`prepare` computed (the rest is computed here).
      head_kernels: head-wise sharing: this layer's gathered ``{"q", "k", "v"}`` kernels ``[D, H, d]``.

    Returns:
      The output, the layer's (K, V), the state handed on and the state whose logits it used (:class:`Attended`).
    """
    role = self.role
    k, v = prepared.kv if prepared.kv is not None else self._kv(x, positions, head_kernels)
    if not role.score_reuse:
      q = prepared.q if prepared.q is not None else self._q(x, positions, head_kernels)
      return self._own_scores(q, segment_ids, k, v)
    state = prepared.state
    if role.score_reuse == ScoreReuse.PROBS:
      out = state.reuse(self.ops, v, segment_ids, window=self.window, dtype=self.dtype)
      return Attended(self._out(out), (k, v), None, None)
    out = state.attend(self.ops, v, segment_ids, window=self.window, dtype=self.dtype,
                       features_dtype=self.chain_dtype)
    return Attended(self._out(out), (k, v), state, state)

  def _out(self, out: jax.Array) -> jax.Array:
    return checkpoint_name(self.o_proj(out), OUT_PROJ)

  def decode(self, x: jax.Array, ctx: StepContext, cache: kv_cache.Buffers, kv_in: DecodeKV | None,
             score_in: jax.Array | None, head_kernels: dict | None = None, nf: bool = False) -> Decoded:
    """Attend with ``n`` new tokens over the cache and their own rows (prefill: the prompt; decode: one token).

    The cache is only read: the new rows are a second key block (:mod:`jaxshare.kernels.decode`) and are returned
    for :func:`jaxshare.model.cache.write`. The source of shared scores emits its rows ``[B, H, n, S + n]``
    (float32): probabilities for SA/UniAttn reusers, which apply them to their own V (SA Alg. 1, UniAttn Eq. 3),
    logits for a LISA chain, whose layers add their low-rank delta from their ``k_lr`` and mix heads (LISA Eq. 3-4,
    decode step of Sec. 4).

    Args:
      x: ``[B, n, D]`` normalised input of the new tokens.
      ctx: the step's positions, mask ``[B, n, S + n]`` and write slot.
      cache: this layer's buffers ``{name: [B, G, S, e]}`` (see :mod:`jaxshare.model.cache`).
      kv_in: a K/V consumer's producer blocks ``((K cache, K new), (V cache, V new))``, heads-major.
      score_in: the rows ``[B, H, n, S + n]`` float32 a score-reusing layer reads.
      head_kernels: head-wise sharing's ``{"q", "k", "v"}`` kernels ``[D, H, d]``.
      nf: LISA's NF prefill (LISA Sec. 5.1): a LISA layer attends with its kept original W_q/W_k over the new
        tokens alone (the cache must be empty), and still returns its ``k_lr`` rows for decoding.

    Returns:
      The output ``[B, n, D]``, the new rows, this layer's K/V blocks and the rows handed on (:class:`Decoded`).

    Raises:
      ValueError: ``nf`` on a LISA layer that did not keep W_q/W_k (``schedule.lisa.keep_qk``).
    """
    role, rows = self.role, {}
    blocks = lambda name: (cache[name], rows[name])  # noqa: E731
    heads_major = lambda t: t.transpose(0, 2, 1, 3)  # noqa: E731  [B, n, G, e] -> [B, G, n, e]
    if role.is_producer:
      rows["v"] = heads_major(self._project("v", x, head_kernels))
      if not role.score_reuse:
        rows["k"] = heads_major(self._rope(self._project("k", x, head_kernels), ctx.positions))
      elif role.has_low_rank:
        q_lr, k_lr = self._low_rank(x, ctx.positions)
        rows["k_lr"] = heads_major(k_lr)
      rows = {name: r.astype(cache[name].dtype) for name, r in rows.items()}
      k, v = (blocks("k") if "k" in rows else None), blocks("v")
    else:
      k, v = kv_in
    if not role.score_reuse:
      q = self._rope(self._project("q", x, head_kernels), ctx.positions)
      if not role.feeds:
        out = self.ops.decode_attention(q, k, v, ctx.mask, scale=self.head_dim ** -0.5, dtype=self.dtype)
        return Decoded(self.o_proj(out), rows, (k, v), None)
      logits = self.ops.decode_scores(q, k, self.head_dim ** -0.5)
      probs, _ = self.ops.masked_softmax(logits, ctx.mask)
      handed = probs if role.feeds == ScoreReuse.PROBS else logits
    elif role.score_reuse == ScoreReuse.PROBS:
      probs, handed = score_in, None
    else:
      if nf:
        logits = self._nf_logits(x, ctx.positions, ctx.mask.shape[-1])
      else:
        logits = score_in
        if role.has_low_rank:
          delta = self.ops.decode_scores(q_lr, blocks("k_lr"), role.lisa_rank ** -0.5)
          logits = scores.integrate(role.integrator, logits, delta, self._aligner_weights())
      probs, _ = self.ops.masked_softmax(logits, ctx.mask)
      handed = logits
    return Decoded(self.o_proj(self.ops.decode_apply_probs(probs, v, self.dtype)), rows, (k, v), handed)

  def _nf_logits(self, x: jax.Array, positions: jax.Array, keys: int) -> jax.Array:
    """NF prefill: the original attention's logits over the new tokens, ``[B, H, n, keys]`` with the (empty)
    cache's columns first."""
    if self.q_proj is None or self.k_proj is None:
      raise ValueError("LISA's NF prefill attends with the layer's original W_q/W_k; this model did not keep "
                       "them: set schedule.lisa.keep_qk=true (uptraining keeps the dense model's)")
    q, k = self._rope(self.q_proj(x), positions), self._rope(self.k_proj(x), positions)
    logits = self.ops.scores(q, k, self.head_dim ** -0.5)
    return jnp.pad(logits, ((0, 0), (0, 0), (0, 0), (keys - logits.shape[-1], 0)))

  def _own_scores(self, q, segment_ids, k, v) -> Attended:
    if k is None:
      raise ValueError("this layer computes its own scores but its K/V producer has no K")
    role, scale = self.role, self.head_dim ** -0.5
    if role.feeds and not self.recompute:  # materialise once: for this layer's output and for its readers
      a = self.ops.scores(q, k, scale)
      out, probs = self.ops.logits_attention(a, v, segment_ids, window=self.window, dtype=self.dtype)
      state = ScoreTensors(logits=a) if role.feeds == ScoreReuse.LOGITS else ScoreTensors(probs=probs)
      return Attended(self._out(out), (k, v), state, ScoreTensors(logits=a))
    if role.feeds:
      out, lse = self.ops.attention(q, k, v, segment_ids, segment_ids, causal=True, scale=scale, window=self.window,
                                    return_lse=True)
      state = ScoreFeatures(q, k, lse, scale)
      return Attended(self._out(out), (k, v), state, state)
    out = self.ops.attention(q, k, v, segment_ids, segment_ids, causal=True, scale=scale, window=self.window)
    return Attended(self._out(out), (k, v), None, ScoreFeatures(q, k, None, scale))
