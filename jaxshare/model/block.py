"""A decoder layer, a run of identical layers (stacked and scanned) and a superblock (runs closed under K/V and
score references)."""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from jaxshare import context, parallel
from jaxshare.config.choices import ScoreReuse, ScoreSharing
from jaxshare.model import cache as kv_cache
from jaxshare.model import remat, scores
from jaxshare.model.attention import KV, Attended, Attention, Decoded, DecodeKV, Prepared
from jaxshare.model.cache import StepContext
from jaxshare.model.layers import MLP, DenseGeneral, cast_to_compute, make_norm
from jaxshare.model.scan import scan_or_unroll
from jaxshare.model.source_projection import SourceProjection, recomputed_queries
from jaxshare.model.scores import AlignerChain, ScoreFeatures, ScoreState
from jaxshare.plan import ModelPlan
from jaxshare.schedule import LayerRole, RunPlan

_RESIDUAL = ("activation_batch", "activation_length", "activation_embed")


class MHAActivations(NamedTuple):
  """One layer's attention block seen from the residual stream, ``[B, T, D]`` each (UniAttn Eq. 5's terms):
  ``input`` the residual x, ``normed`` Norm(x) (what the projections read), ``output`` x' = x + MHA(x) (+ x W_c)."""

  input: jax.Array
  normed: jax.Array
  output: jax.Array


@dataclasses.dataclass(frozen=True)
class RunOut:
  """What a run of layers hands back in a forward pass.

  Attributes:
    y: ``[B, T, D]`` the residual stream.
    kv: the run's (K, V), for the consumers of its superblock; only from a run of one layer.
    handed: the score state later layers reuse (a LISA chain's carried state, or a one-layer run's own).
    captured: per layer, what the forward pass captures (see :meth:`LayerRun.__call__`).
  """

  y: jax.Array
  kv: KV | None
  handed: ScoreState | None
  captured: list


class DecoderLayer(nnx.Module):
  """Pre-norm transformer layer.

  Sequential residual (llama's default): ``h = x + attn(norm1 x); y = h + mlp(norm2 h)``.
  Parallel residual (neox's default, GPT-NeoX/Pythia): ``y = x + attn(norm1 x) + mlp(norm2 x)``.
  With UniAttn's compensation the attention output gains ``x W_c`` (Eq. 5; ``W_c [D, D]``, no bias, zero-initialised
  so that training starts from plain probability reuse), its input being the residual ``x`` or ``norm1 x``.
  """

  def __init__(self, plan: ModelPlan, role: LayerRole, *, rngs: nnx.Rngs):
    cfg = plan.model
    pdtype = jnp.dtype(cfg.param_dtype)
    features = cfg.features
    self.parallel_residual, self.wc_normed = features.parallel_residual, role.wc_normed
    self.norm1 = make_norm(features.norm, cfg.d_model, cfg.norm_eps, pdtype)
    self.attn = Attention(plan, role, rngs=rngs)
    self.compensation = DenseGeneral(
      "btd,de->bte", (cfg.d_model, cfg.d_model), ("embed", None), std=None, bias_shape=None,
      dtype=jnp.dtype(cfg.dtype), param_dtype=pdtype, rngs=rngs) if role.compensation else None
    self.norm2 = make_norm(features.norm, cfg.d_model, cfg.norm_eps, pdtype)
    self.mlp = MLP(features.activation, cfg.d_model, plan.mlp_dim, bias=features.dense_biases, std=cfg.init_std,
                   out_std=cfg.init_std / math.sqrt(2 * cfg.num_layers), dtype=jnp.dtype(cfg.dtype),
                   param_dtype=pdtype, rngs=rngs)

  def prepare(self, x: jax.Array, positions: jax.Array, kv_in: KV | None, score_in: ScoreState | None,
              slot: jax.Array | int = 0, head_kernels: dict | None = None, *, own_kv: bool = False,
              source_q: bool = False) -> Prepared:
    """``x [B,T,D]``: what the layer reads from other layers and, with ``own_kv`` / ``source_q``, what they read
    from it (see :meth:`Attention.prepare`).

    A score source's queries alone (``source_q``, the layer reads no other layer's K/V and hands on none) are
    projected from ``x`` under :func:`~jaxshare.kernels.recompute.recomputed`, so that the backward pass recomputes
    the normalised ``x`` for the projection's gradient: kept, that ``[B, T, D]`` array would live across the
    superblock's whole backward pass, whose reusers run first (the ~1.2B UniAttn at 128k tokens on a node of 8
    H100s, with ``recomputed``'s barrier: 28.09 -> 27.53 GiB under ``model.remat=full``). XLA drops the recomputed
    projection itself, whose output its gradient does not read.
    """
    if not source_q or own_kv or kv_in is not None or self.attn.role.score_reuse:
      return self.attn.prepare(self.norm1(x), positions, kv_in, score_in, slot, head_kernels, own_kv=own_kv,
                               source_q=source_q)
    return recomputed_queries(self.norm1, self.attn, x, positions, head_kernels)

  def __call__(self, x: jax.Array, positions: jax.Array, segment_ids: jax.Array, prepared: Prepared,
               head_kernels: dict | None = None) -> tuple[Attended, MHAActivations]:
    """``x [B,T,D]``: the layer's output as :class:`~jaxshare.model.attention.Attended` (``y`` the residual
    stream ``[B,T,D]``) and its attention block in residual-stream terms; see :meth:`Attention.__call__`."""
    h = self.norm1(x)
    att = self.attn(h, positions, segment_ids, prepared, head_kernels)
    a = self._compensate(x, h, att.y)
    return att.replace(y=self._residual(x, a)), MHAActivations(x, h, x + a)

  def decode(self, x: jax.Array, ctx: StepContext, cache: kv_cache.Buffers, kv_in: DecodeKV | None,
             score_in: jax.Array | None, head_kernels: dict | None = None, nf: bool = False) -> Decoded:
    """``x [B,n,D]``: the layer's step (``y`` the residual stream); see :meth:`Attention.decode`."""
    h = self.norm1(x)
    step = self.attn.decode(h, ctx, cache, kv_in, score_in, head_kernels, nf)
    return dataclasses.replace(step, y=self._residual(x, self._compensate(x, h, step.y)))

  def _compensate(self, x: jax.Array, h: jax.Array, a: jax.Array) -> jax.Array:
    if self.compensation is None:
      return a
    return a + self.compensation(h if self.wc_normed else x)

  def _residual(self, x: jax.Array, a: jax.Array) -> jax.Array:
    if self.parallel_residual:
      y = x + a + self.mlp(self.norm2(x))
    else:
      y = x + a
      y = y + self.mlp(self.norm2(y))
    return parallel.constrain(y.astype(x.dtype), _RESIDUAL)


class LayerRun(nnx.Module):
  """``length`` consecutive layers of one role with parameters stacked on a leading axis, scanned.

  What the layers read from outside the run (a producer's K/V, a probability source) is loop-invariant; a LISA
  chain's score state is carried from layer to layer in a fixed shape (see :func:`scores.chain_entry`). Under
  ``model.remat`` each layer runs under its policy's checkpoint (:mod:`jaxshare.model.remat`).

  Args:
    hoist: what the layers share with other layers of their superblock (``shares_kv``: this one-layer run's K/V;
      ``shares_q``: its queries, whose scores others reuse; a LISA chain's low-rank delta) is computed outside the
      layers' checkpoints, where the superblock's checkpoint recomputes it once for all its readers.
    unroll: the run's layers are unrolled whatever ``model.scan_layers`` says (see :func:`unrolled`).
  """

  def __init__(self, plan: ModelPlan, run: RunPlan, *, hoist: bool = False, shares_kv: bool = False,
               shares_q: bool = False, unroll: bool = False, rngs: nnx.Rngs):
    self.length, self.role, self.scan = run.length, run.role, plan.model.scan_layers and not unroll
    self.recompute = plan.attention.score_sharing == ScoreSharing.RECOMPUTE
    self.remat = plan.model.remat
    self.hoist, self.shares_kv, self.shares_q = hoist, shares_kv, shares_q
    # the superblock's input is its checkpoint's own argument, kept anyway: naming it would keep a second copy
    self.named_input = hoist and run.start > 0

    @nnx.split_rngs(splits=run.length)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def make(rngs: nnx.Rngs) -> DecoderLayer:
      return DecoderLayer(plan, run.role, rngs=rngs)

    self.layers = make(rngs)

  def __call__(self, x: jax.Array, positions: jax.Array, segment_ids: jax.Array, kv_in: KV | None,
               score_in: ScoreState | None, head_kernels: dict | None, capture: str | None) -> RunOut:
    """Apply the run.

    Args:
      kv_in / score_in: what every layer reads (a LISA chain: the state of the layer before the run).
      head_kernels: head-wise sharing's kernels ``[length, D, H, d]`` per matrix.
      capture: ``"logits"``: also return the logits each layer used (``[B, H, T, S]`` float32 each; none for
        probability reusers, whose source's logits stand for theirs); ``"mha"``: each layer's
        :class:`MHAActivations`; ``"kv"``: the ``(K, V)`` each layer attended with (``[B, S, G, d]``, K rotated).

    Returns:
      :class:`RunOut`; K/V and a non-chain state only for a run of one layer (longer runs hold no layer that
      another layer reads by position).
    """
    role = self.role
    chain = role.score_reuse == ScoreReuse.LOGITS
    base, width = 0, role.lisa_rank
    if chain:
      score_in = scores.chain_entry(score_in, integrator=role.integrator, num_kv_heads=role.num_kv_heads,
                                    slots=self.length, rank=role.lisa_rank, hidden=role.lisa_hidden,
                                    recompute=self.recompute)
      if isinstance(score_in, ScoreFeatures) and role.has_low_rank:
        base = score_in.q.shape[-1] - self.length * role.lisa_rank
      elif isinstance(score_in, AlignerChain):  # one slot per layer
        base, width = score_in.q_lr.shape[0] - self.length, 1
    call = self._layer_call(capture)

    def body(layer: DecoderLayer, carry, i, kernels, stacked: bool = False):
      x, state = carry
      if self.named_input:  # what a superblock's checkpoint keeps of each layer after its first
        x = checkpoint_name(x, remat.LAYER_INPUT)
      score, slot = (state if chain else score_in), base + i * width
      prepared = None
      if self.hoist:  # what other layers share, outside the layer's checkpoint
        prepared = (self._first(layer) if stacked else layer).prepare(
          x, positions, kv_in, score, slot, kernels, own_kv=self.shares_kv, source_q=self.shares_q)
      out, item = call(layer, x, positions, segment_ids, *((None, None) if self.hoist else (kv_in, score)), slot,
                       kernels, prepared, stacked)
      handed = _keep_lse(out.handed)
      return (out.y, handed if chain else None), (out.kv, handed, item)

    carry = (x, score_in if chain else None)
    if self.length == 1:  # the only layer: what it hands on (its K/V, its scores) may be read by position
      (x, _), (kv, state, item) = body(self.layers, carry, 0, self._first(head_kernels), stacked=True)
      return RunOut(x, kv, state, [item] if self._captures(capture) else [])

    def step(layer, carry, per_layer):
      carry, (_, _, logits) = body(layer, carry, *per_layer)
      return carry, logits

    # scanned here, the layers' parameters are a slice of a scanned stack's: held in the compute dtype
    layers = cast_to_compute(self.layers) if self.scan else self.layers
    (x, state), logits = scan_or_unroll(step, layers, carry, (jnp.arange(self.length), head_kernels),
                                        count=self.length, scan=self.scan)
    captured = [jax.tree.map(lambda a: a[i], logits) for i in range(self.length)] if self._captures(capture) else []
    return RunOut(x, None, state, captured)

  def _layer_call(self, capture: str | None):
    """One layer's forward (its :meth:`DecoderLayer.prepare`, unless prepared outside, and its call), under the
    layer's checkpoint when ``model.remat`` asks for one. Returns ``(Attended without its used state, capture)``."""
    def call(layer: DecoderLayer, x, positions, segment_ids, kv_in, score, slot, kernels, prepared, stacked):
      if stacked:  # sliced inside the checkpoint, which then keeps no copy of the parameters
        layer = LayerRun._first(layer)
      if prepared is None:
        prepared = layer.prepare(x, positions, kv_in, score, slot, kernels)
      out, mha = layer(x, positions, segment_ids, prepared, kernels)
      item = (mha if capture == "mha" else out.kv if capture == "kv" else
              scores.logits(out.used) if capture and out.used is not None else None)
      return out.replace(used=None), item

    if not remat.enabled(self.remat):
      return call
    return remat.checkpoint(call, remat.layer_policy(self.remat), static_argnums=(9,))

  def decode(self, x: jax.Array, ctx: StepContext, buffers: kv_cache.Buffers, kv_in: DecodeKV | None,
             score_in: jax.Array | None, head_kernels: dict | None, nf: bool = False) -> Decoded:
    """One decode step of the run (scanned like :meth:`__call__`): layer i reads ``{name: b[i]}`` of the run's
    cache ``buffers`` ``{name: [length, B, G, S, e]}`` (one superblock's) and adds rows ``{name: [length, B, G, n,
    e]}``; K/V blocks only from a one-layer run; a LISA chain carries its logits rows from layer to layer.
    """
    chain = self.role.score_reuse == ScoreReuse.LOGITS

    def body(layer: DecoderLayer, carry, cache, kernels):
      x, rows_in = carry
      step = layer.decode(x, ctx, cache, kv_in, rows_in if chain else score_in, kernels, nf)
      return (step.y, step.handed if chain else None), (step.rows, step.kv, step.handed)

    carry = (x, score_in if chain else None)
    if self.length == 1:
      (x, _), (new, kv, handed) = body(self._first(self.layers), carry, self._first(buffers),
                                       self._first(head_kernels))
      return Decoded(x, jax.tree.map(lambda r: r[None], new), kv, handed)

    def step(layer, carry, per_layer):
      carry, (new, _, _) = body(layer, carry, *per_layer)
      return carry, new

    (x, chained), rows = scan_or_unroll(step, self.layers, carry, (buffers, head_kernels), count=self.length,
                                        scan=self.scan)
    return Decoded(x, rows, None, chained)

  @staticmethod
  def _first(tree):
    """The first of a stack: a module's parameters (split, sliced and merged), or an array tree's."""
    if isinstance(tree, nnx.Module):
      graphdef, params = nnx.split(tree)
      return nnx.merge(graphdef, jax.tree.map(lambda a: a[0], params))
    return jax.tree.map(lambda a: a[0], tree)

  def _captures(self, capture: str | None) -> bool:
    """Whether this run returns its own captures (a probability reuser has no logits of its own)."""
    return capture in ("mha", "kv") or (capture == "logits" and self.role.score_reuse != ScoreReuse.PROBS)


def unrolled(plan: ModelPlan, runs: tuple[RunPlan, ...]) -> bool:
  """Whether a superblock of ``runs``, its runs and its stack are unrolled whatever ``model.scan_layers`` says: under
  ``model.remat=none`` when it has several layers, under ``minimal`` when it has more than two.

  A scanned stack's backward pass slices a whole superblock's residuals at once (and a scan inside it stacks its
  layers' residuals a second time), where dense's slices one layer's; unrolled, XLA frees each layer's residuals
  after its backward pass. That costs most where a layer keeps most: under ``none`` (the ~1.2B Llama on one H100 at
  32k: MLKV 4x8 43.70 GiB unrolled, 52.34 scanned, dense 51.22; :mod:`jaxshare.model.remat`) and under ``minimal``,
  which keeps every weight matmul's output, the MLP's included (MLKV 4x8 41.08 unrolled, 48.75 scanned, UniAttn 43.59
  and 52.05, dense 48.03; on a node of 8 at 32k MLKV 27.23 and 34.52, UniAttn 30.26 and 38.24, dense 33.27; scanned,
  MLKV's live bytes at the peak were 7 GiB below dense's and XLA's packing of the loop's temporaries put the compiled
  peak above). CLA2's superblocks of two stay scanned: scanned it is below dense in every cell measured (2k, 8k and
  32k, one H100 and a node of 8), unrolled it is not on the node at 2k (4.79 GiB against dense's 4.68). Under the
  other policies each layer keeps little, and a scanned stack is at or below dense on a node of 8 where an unrolled
  one is not (``full`` at 32k: MLKV 15.84 GiB unrolled, 7.93 scanned, dense 9.07: XLA schedules an unrolled stack's
  FSDP gathers apart from their layers), and compile time stays independent of depth (``docs/scale-out.md``)."""
  layers = sum(run.length for run in runs)
  if not remat.enabled(plan.model.remat):
    return layers > 1
  return remat.keeps_every_matmul(plan.model.remat) and layers > 2


def run_unrolled(plan: ModelPlan, runs: tuple[RunPlan, ...]) -> bool:
  """Whether the runs of a superblock of ``runs`` are unrolled inside it: as its stack (:func:`unrolled`), and under a
  host-offloading policy, whose offloaded residuals XLA's GPU compiler (jax 0.10) cannot keep for a scan inside the
  stack's scan (``INTERNAL: ... Expected instruction to have shape equal to ...S(5)``, the pinned-host memory space:
  MLKV 4x8 and UniAttn on the ~1.2B Llama under ``minimal_offloaded`` and ``qkv_proj_offloaded``)."""
  return unrolled(plan, runs) or remat.offloads(plan.model.remat)


def shared_checkpoint(plan: ModelPlan, runs: tuple[RunPlan, ...]) -> bool:
  """Whether a superblock of ``runs`` runs under its own checkpoint (:func:`jaxshare.model.remat.superblock_policy`):
  under ``model.remat`` when it has several layers, whose shared tensors it then recomputes once for all readers."""
  return remat.enabled(plan.model.remat) and sum(run.length for run in runs) > 1


def superblock_checkpoint(plan: ModelPlan, runs: tuple[RunPlan, ...]) -> str | None:
  """The ``model.remat`` name of the checkpoint around a superblock of ``runs`` (None: it has none): without remat
  every superblock's (:func:`jaxshare.model.remat.keep_all_but_elementwise`), under a policy a several-layer
  superblock's (:func:`shared_checkpoint`). A name, not the policy: a policy is a fresh function each time, and NNX
  compares graphs by their static fields."""
  return plan.model.remat if shared_checkpoint(plan, runs) or not remat.enabled(plan.model.remat) else None


def _keep_lse(state: ScoreState | None) -> ScoreState | None:
  """A score source's state with its log-sum-exp named for the superblock's checkpoint to keep
  (:data:`~jaxshare.model.remat.SCORE_LSE`): ``[B, H, T]`` float32, which recomputing would cost an attention."""
  if isinstance(state, ScoreFeatures) and state.lse is not None:
    return state.replace(lse=checkpoint_name(state.lse, remat.SCORE_LSE))
  return state


class Superblock(nnx.Module):
  """Consecutive layers closed under K/V and score references, as runs of identical layers; the unit that is
  stacked and scanned over a stack.

  Args:
    runs: the superblock's runs (:func:`jaxshare.schedule.layer_runs`).
  """

  def __init__(self, plan: ModelPlan, runs: tuple[RunPlan, ...], *, rngs: nnx.Rngs):
    self.plan = tuple(runs)
    hoist = shared_checkpoint(plan, runs)
    self.route = hoist  # probability reusers send their gradient through their source's projections
    read_kv = {run.role.kv_from for run in runs}
    recompute = plan.attention.score_sharing == ScoreSharing.RECOMPUTE
    self.runs = nnx.List([LayerRun(plan, run, hoist=hoist, shares_kv=run.start in read_kv and run.role.is_producer,
                                   shares_q=bool(run.role.feeds) and recompute, unroll=run_unrolled(plan, runs),
                                   rngs=rngs)
                           for run in runs])

  def __call__(self, x: jax.Array, positions: jax.Array, segment_ids: jax.Array, capture: str | None = None,
               head_kernels: dict | None = None) -> tuple[jax.Array, tuple]:
    """Returns the residual stream and, per layer, with ``capture="logits"`` the pre-softmax logits ``[B,H,T,T]``
    (f32; a probability reuser's are its source's), with ``capture="mha"`` its :class:`MHAActivations`, with
    ``capture="kv"`` the ``(K, V)`` it attended with.

    ``head_kernels`` (head-wise sharing): ``{"q", "k", "v"}`` kernels ``[superblock size, D, H, d]``.
    """
    kvs: dict[int, KV] = {}
    states: dict[int, ScoreState | None] = {}
    captured: list[jax.Array] = []
    previous = None
    inputs: dict[int, jax.Array] = {}
    for run, module in zip(self.plan, self.runs):
      role = run.role
      inputs[run.start] = x
      kv_in = None if role.kv_from is None else kvs[role.kv_from]
      score_in = {"probs": states.get(role.score_from), "logits": previous}.get(role.score_reuse)
      if role.score_reuse == ScoreReuse.PROBS and head_kernels is None:
        score_in = self._routed(score_in, role.score_from, inputs, positions)
      kernels = None if head_kernels is None else {
        m: w[run.start:run.start + run.length] for m, w in head_kernels.items()}
      out = module(x, positions, segment_ids, kv_in, score_in, kernels, capture)
      x, kvs[run.start], states[run.start] = out.y, out.kv, out.handed
      previous = out.handed
      if capture:
        captured.extend(out.captured if module._captures(capture) else [captured[role.score_from]] * run.length)
    return x, tuple(captured)

  def _routed(self, state: ScoreState | None, source: int, inputs: dict[int, jax.Array],
              positions: jax.Array) -> ScoreState | None:
    """A probability source's ``state`` as its reusers read it under a superblock checkpoint: with the
    :class:`~jaxshare.model.source_projection.SourceProjection` of the layer at ``source`` (its input
    ``inputs[source]``), through which they send their gradient at once, when the source projects its own Q and K;
    else unchanged. Under context parallelism the reusers keep reading the gathered keys with their gradient (the
    projection's backward pass would gather them once more per reuser)."""
    if not (self.route and isinstance(state, ScoreFeatures)) or context.active():
      return state
    layer = LayerRun._first(next(m for p, m in zip(self.plan, self.runs) if p.start == source).layers)
    if layer.attn.q_proj is None or layer.attn.k_proj is None:  # its K is a producer's
      return state
    return state.replace(q=jax.lax.stop_gradient(state.q), k=jax.lax.stop_gradient(state.k),
                         source=SourceProjection.of(layer.norm1, layer.attn, inputs[source], positions))

  def decode(self, x: jax.Array, ctx: StepContext, buffers: list[kv_cache.Buffers], head_kernels: dict | None = None,
             nf: bool = False) -> tuple[jax.Array, list[kv_cache.Buffers]]:
    """One decode step of the superblock: ``buffers`` holds each run's cache ``{name: [length, B, G, S, e]}``; the
    producers' K/V and the score rows pass to the layers that read them within the step. Returns ``x`` and each
    run's new rows ``{name: [length, B, G, n, e]}``."""
    kvs: dict[int, DecodeKV | None] = {}
    handed: dict[int, jax.Array | None] = {}
    out, previous = [], None
    for run, module, buf in zip(self.plan, self.runs, buffers):
      role = run.role
      kv_in = None if role.kv_from is None else kvs[role.kv_from]
      score_in = {"probs": handed.get(role.score_from), "logits": previous}.get(role.score_reuse)
      kernels = None if head_kernels is None else {
        m: w[run.start:run.start + run.length] for m, w in head_kernels.items()}
      step = module.decode(x, ctx, buf, kv_in, score_in, kernels, nf)
      x, kvs[run.start], handed[run.start] = step.y, step.kv, step.handed
      previous = step.handed
      out.append(step.rows)
    return x, out
