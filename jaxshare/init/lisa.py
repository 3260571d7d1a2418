"""LISA's conversion starts (``train.init_lisa``): the new low-rank factors of a model converted into LISA.

The ``ds`` start (:func:`init_low_rank`): the low-rank ``k_lr`` starts at zero, so ``A_delta = Q_lr K_lr^T = 0``
and, with the aligners' identity-on-``A_{n-1}`` initialisation (:func:`jaxshare.model.attention.sum_aligner`), every
LISA layer starts as DS, the exact reuse of the previous layer's logits that the papers evaluate untrained (LISA's
DS rows; UniAttn's unification without W_c). This start is jaxshare's choice: LISA prescribes no initialisation for
a conversion, and its analysis shows plain reuse is what does not work untrained. A random ``A_delta`` would add
noise carrying nothing about the source; an SVD of the layer's own ``W_q W_k^T`` approximates its logits, not the difference to the reused ones, and is not
position-independent under RoPE. As in LoRA's zero-initialised factor, ``q_lr`` stays random so that ``k_lr``
receives gradients from the first step (``dL/dK_lr = Q_lr^T dL/dA_delta``).

The ``fit`` start: low-rank factors whose delta makes a converted layer's logits approximate its own.

A LISA layer n computes ``A_n = A_s + A_delta`` (LISA Eq. 3, with the aligner at its initial sum), where ``A_s`` are
the logits of its score source s (the previous layer) and ``A_delta = (x W_q^LR)(x W_k^LR)^T / sqrt(r)``. In the
dense source, without RoPE, head h's logits are the bilinear form ``x M x^T`` with ``M = W_q,h W_k,g(h)^T / sqrt(d)``.
The start that brings ``A_n`` closest to the source layer's own logits sets ``W_q^LR W_k^LR^T / sqrt(r)`` to the
difference ``M_n - M_s``: the best rank-r approximation of it (Eckart-Young: truncated SVD), with one K factor per
K/V group, so the query heads of a group are stacked before the SVD. Along a chain the differences telescope
(``A_s`` is itself fitted towards ``M_s``). This is the fit UniAttn does for its W_c (there on activations); LISA
itself prescribes no conversion start. What the fit ignores: RoPE (the source's logits are rotated; the low-rank
path is rotated only with ``schedule.lisa.rope``, at its own width) and that layers n and s see different inputs.

:func:`calibrate_low_rank` removes both approximations, on data, as UniAttn fits its W_c on calibration batches: it
starts from that fit and minimises, by Adam on the factors alone, the squared error between the logits each LISA
layer of the converted model *uses* (``A_s + A_delta``, in that model's own forward pass: its own inputs, RoPE as
configured, the chain's earlier layers already converted) and the source layer's own logits, over every causal
position of the calibration batches.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Iterable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from jaxshare.config import ConfigError
from jaxshare.config.choices import LisaStart, parse
from jaxshare.init.shared import same_shapes
from jaxshare.kernels import reference
from jaxshare.model import params as P
from jaxshare.schedule import Schedule


def fit_low_rank(wq_n, wk_n, wq_s, wk_s, rank: int, kv_heads: int) -> tuple[jnp.ndarray, jnp.ndarray]:
  """LISA's low-rank factors fitted to a source layer's logits (module docstring). Traceable.

  Args:
    wq_n, wk_n: the source's layer n ``W_q [D, H, d]`` and ``W_k [D, G_n, d]`` (G_n dividing H).
    wq_s, wk_s: the same for its score source s (``W_k [D, G_s, d]``).
    rank: r, the LISA rank.
    kv_heads: G, the converted layer's K/V heads (``k_lr``'s), dividing H.

  Returns:
    ``(q_lr [D, H, r], k_lr [D, G, r])`` float32 with ``q_lr_h k_lr_g(h)^T / sqrt(r)`` the best rank-r approximation
    (Frobenius, jointly over each K/V group's query heads) of ``(W_q,n,h W_k,n^T - W_q,s,h W_k,s^T) / sqrt(d)``.

  Raises:
    ValueError: shapes that disagree, or head counts that do not divide H.
  """
  D, H, d = wq_n.shape
  if wq_s.shape != (D, H, d) or wk_n.shape[::2] != (D, d) or wk_s.shape[::2] != (D, d):
    raise ValueError(f"W_q/W_k shapes disagree: {wq_n.shape}, {wk_n.shape}, {wq_s.shape}, {wk_s.shape}")
  if any(H % g for g in (wk_n.shape[1], wk_s.shape[1], kv_heads)):
    raise ValueError(f"K/V head counts {wk_n.shape[1]}, {wk_s.shape[1]}, {kv_heads} must divide {H} query heads")
  f32 = jnp.float32

  def bilinear(wq, wk):  # [H, D, D]
    k = jnp.repeat(wk.astype(f32), H // wk.shape[1], axis=1)
    return jnp.einsum("dhe,fhe->hdf", wq.astype(f32), k) * d ** -0.5

  per_group = H // kv_heads
  delta = (bilinear(wq_n, wk_n) - bilinear(wq_s, wk_s)).reshape(kv_heads, per_group * D, D)
  u, s, vt = jnp.linalg.svd(delta, full_matrices=False)  # [G, hD, k], [G, k], [G, k, D]
  root = jnp.sqrt(s[:, :rank]) * rank ** 0.25  # split sqrt(r) * S_r evenly between the factors
  q_lr = (u[:, :, :rank] * root[:, None]).reshape(kv_heads, per_group, D, rank)
  k_lr = vt[:, :rank].transpose(0, 2, 1) * root[:, None]  # [G, D, r]
  return q_lr.reshape(H, D, rank).transpose(1, 0, 2), k_lr.transpose(1, 0, 2)


@dataclasses.dataclass(frozen=True)
class LowRankCalibration:
  """How close the calibrated LISA layers' logits are to the source's, on the calibration batches: the squared error
  of ``A_s + A_delta`` against the source's own logits over the positions each query attends, relative to that of
  plain reuse (``A_delta = 0``, the DS start: 1.0 by definition; NaN where plain reuse is already exact), for the
  starting factors and the returned ones. ``kept_start``: Adam did not improve on the start, which is returned."""

  layers: tuple[int, ...]
  start: float
  calibrated: float
  kept_start: bool


def calibrate_low_rank(src: tuple[nnx.GraphDef, dict], dst: tuple[nnx.GraphDef, dict], schedule: Schedule,
                       batches: Iterable[dict[str, np.ndarray]], layers: Sequence[int] | None = None, *,
                       window: int = 0, steps: int = 200, learning_rate: float = 3e-3
                       ) -> tuple[dict, LowRankCalibration]:
  """LISA's calibrated conversion start (module docstring): the ``q_lr``, ``k_lr`` of ``dst``'s LISA layers trained
  so that the logits each layer uses match the source layer's own on ``batches``; nothing else changes.

  Args:
    src: the source model ``(graphdef, params)`` (pure dicts), e.g. the dense model converted into ``dst``.
    dst: the converted model; its current factors are the starting point (e.g. :func:`fit_low_rank`'s).
    schedule: ``dst``'s compiled schedule.
    batches: calibration batches (``inputs``, ``positions``, ``segment_ids``; ``[B, T]`` each).
    layers: the LISA layers to calibrate (default: every layer with low-rank factors).
    window: ``model.sliding_window`` (0: none): the positions compared are those a query attends.
    steps: Adam steps, cycling through the batches.
    learning_rate: Adam's step size (constant).

  Every step runs ``dst``'s forward pass with every layer's ``[B, H, T, T]`` float32 logits materialised (and the
  targets of the calibrated layers are kept for all batches): calibrate large models on short sequences.

  Returns:
    ``(dst params with the calibrated factors, LowRankCalibration)``; errors are summed over ``layers``.

  Raises:
    ValueError: no layer to calibrate or one without low-rank factors, ``batches`` is empty, or ``steps < 0``.
  """
  low_rank = [p.index for p in schedule.layers if p.has_low_rank]
  layers = tuple(low_rank if layers is None else layers)
  if not layers or not set(layers) <= set(low_rank):
    raise ValueError(f"LISA calibration of layers {list(layers)}: must be a non-empty subset of the layers with "
                     f"low-rank factors {low_rank} of schedule {schedule.describe()}")
  batches = [jax.tree.map(jnp.asarray, b) for b in batches]
  if not batches:
    raise ValueError("LISA calibration needs at least one batch")
  if steps < 0:
    raise ValueError(f"LISA calibration steps={steps} is invalid: must be >= 0")
  index = jnp.asarray(layers)

  @functools.partial(jax.jit, static_argnums=0)
  def attention_logits(graphdef, params, batch):  # [n, B, H, T, T]
    return nnx.merge(graphdef, params).capture_logits(batch.inputs, batch.positions, batch.segment_ids)[1][index]

  targets = [attention_logits(src[0], src[1], b) for b in batches]

  def factors(params):
    return {n: {k: P.layer_params(params, schedule, n)["attn"][k] for k in ("q_lr", "k_lr")} for n in layers}

  def with_factors(params, fs):
    for n, f in fs.items():
      old = P.layer_params(params, schedule, n)
      params = P.replace_layer(params, schedule, n, {**old, "attn": {**old["attn"], **f}})
    return params

  @jax.jit
  def sse(fs, params, batch, target):
    got = attention_logits(dst[0], with_factors(params, fs), batch)
    seg = batch.segment_ids
    visible = reference.attention_mask(seg, seg, True, window)[:, None]  # [B, 1, T, T]
    return jnp.sum(jnp.where(visible, (got - target) ** 2, 0.0))

  def total(fs, params):
    return sum(float(sse(fs, params, b, t)) for b, t in zip(batches, targets))

  params = jax.tree.map(jnp.asarray, dst[1])
  fs = jax.tree.map(lambda a: a.astype(jnp.float32), factors(params))
  baseline = total({n: {**f, "k_lr": jax.tree.map(jnp.zeros_like, f["k_lr"])} for n, f in fs.items()}, params)
  start = total(fs, params)
  optimizer = optax.adam(learning_rate)
  tokens = batches[0].inputs.size

  @jax.jit
  def step(fs, opt_state, params, batch, target):
    grads = jax.grad(lambda f: sse(f, params, batch, target) / tokens)(fs)
    updates, opt_state = optimizer.update(grads, opt_state, fs)
    return optax.apply_updates(fs, updates), opt_state

  opt_state = optimizer.init(fs)
  start_fs = fs
  for i in range(steps):
    fs, opt_state = step(fs, opt_state, params, batches[i % len(batches)], targets[i % len(targets)])
  calibrated = total(fs, params)
  kept = calibrated >= start  # Adam did not improve on these batches: the start is the better one
  relative = (lambda e: e / baseline) if baseline > 0 else (lambda e: float("nan"))
  return (with_factors(params, start_fs if kept else fs),
          LowRankCalibration(layers, relative(start), relative(min(start, calibrated)), kept))


def fittable_lisa_layers(src: dict, src_schedule: Schedule, dst_schedule: Schedule) -> list[int]:
  """LISA layers of ``dst_schedule`` whose layer and score source both have their own W_q and W_k in the source
  (what ``train.init_lisa=fit`` needs; shapes only)."""
  def own_qk(layer):
    attn = jax.eval_shape(lambda: P.layer_params(src, src_schedule, layer))["attn"]
    return "q_proj" in attn and "k_proj" in attn
  return [p.index for p in dst_schedule.layers if p.has_low_rank and own_qk(p.index) and own_qk(p.score_source)]


def init_low_rank(src: dict, src_schedule: Schedule, dst: dict, dst_schedule: Schedule, start: str = "ds") -> dict:
  """``dst``'s LISA layers started from the source, for those the source has no low-rank K for (a LISA source's
  trained ``q_lr``/``k_lr`` stay as copied). ``ds``: ``k_lr`` zeroed (``A_delta = 0``: the layer starts as DS; see
  the module docstring). ``fit``: ``q_lr``, ``k_lr`` from :func:`fit_low_rank` on the
  source's W_q, W_k of the layer and its score source (layers without them start as ``ds``). Traceable.

  Raises:
    ValueError: ``start`` is invalid.
  """
  start = parse(LisaStart, start, "train.init_lisa")
  fittable = fittable_lisa_layers(src, src_schedule, dst_schedule) if start == "fit" else []
  out = dst
  for plan in dst_schedule.layers:
    layer = P.layer_params(out, dst_schedule, plan.index)
    if "k_lr" not in layer["attn"] or same_shapes(P.layer_params(src, src_schedule, plan.index)["attn"].get("k_lr"),
                                                   layer["attn"]["k_lr"]):
      continue
    if start == "calibrated":
      raise ConfigError(f"train.init_lisa=calibrated needs calibration batches, which only `python -m "
                        f"jaxshare.convert uptrain` reads (layer {plan.index} starts from the source here): convert "
                        "with it and set train.init_from to the converted run, or use train.init_lisa=ds or fit")
    attn = {**layer["attn"], "k_lr": jax.tree.map(jnp.zeros_like, layer["attn"]["k_lr"])}
    if plan.index in fittable:
      own, prev = (P.layer_params(src, src_schedule, i)["attn"] for i in (plan.index, plan.score_source))
      q_lr, k_lr = fit_low_rank(own["q_proj"]["kernel"], own["k_proj"]["kernel"], prev["q_proj"]["kernel"],
                                prev["k_proj"]["kernel"], attn["q_lr"]["kernel"].shape[-1], plan.num_kv_heads)
      attn["q_lr"] = {**attn["q_lr"], "kernel": q_lr.astype(attn["q_lr"]["kernel"].dtype)}
      attn["k_lr"] = {**attn["k_lr"], "kernel": k_lr.astype(attn["k_lr"]["kernel"].dtype)}
    out = P.replace_layer(out, dst_schedule, plan.index, {**layer, "attn": attn})
  return out
