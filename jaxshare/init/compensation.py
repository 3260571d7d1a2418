"""UniAttn's closed-form initialisation of the linear compensation W_c on calibration batches (UniAttn, Xiong et al.
2025, Theorem 3.1 and Algorithm 1).

A layer that reuses its superblock's softmax probabilities gains ``x W_c`` (Eq. 5). Unifying the probabilities
changes the layer's attention-block output ``x' = x + MHA(x)`` by ``eps = x'_original - x'_unified`` (Eq. 4: the
original model's and the UniAttn model's outputs at that layer, each run on its own inputs). Theorem 3.1: the W_c
that best compensates ``E(eps)`` from ``E(x)`` is ``W_c = V Sigma^+ U^T E(eps)``, with ``U Sigma V^T`` the SVD of
``E(x)``, i.e. the minimum-norm least-squares solution of ``E(x) W_c = E(eps)``. The expectations are averages over
calibration samples at each position (``fit="mean"``, the paper's ``v = 1``: ``E(x)`` is ``[T, D]``); ``fit="tokens"``
instead solves the least squares over every calibration token (``[N*T, D]``), the "all-token" alternative
``methods-lisa-uniattn.md`` Sec. 2.7 names. ``mean`` needs T well above D: at T = D (the uptraining experiment in
the README, T = D = 128) the square system fits the mean error exactly with a W_c that fails on single tokens
(validation loss 6.41 after conversion against 1.96 with ``tokens``: the experiment's ``uniattn_wcmean`` row in
docs/results.md), so the CLI defaults to ``tokens``. Algorithm 1 works bottom-up: each W_c is fitted with every W_c
below it already inserted, since those change the inputs above.

Every quantity is accumulated in float64 on the host, per layer: sums of ``x`` and ``eps`` over samples (``mean``)
or the normal-equation Gram matrices ``X^T X``, ``X^T eps`` (``tokens``), so memory does not grow with the number of
batches beyond the original model's outputs at the compensated layers.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Iterable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxshare.config.choices import WcFit, parse
from jaxshare.model import params as P
from jaxshare.model.loss import masked_cross_entropy
from jaxshare.schedule import Schedule



@dataclasses.dataclass(frozen=True)
class CompensationFit:
  """One layer's fitted W_c and its compensation error ``||E(x) W_c - E(eps)||_F`` (the paper's metric, over the
  position-wise sample means) before (W_c = 0) and after."""

  layer: int
  kernel: np.ndarray  # [D, D] float64
  error_before: float
  error_after: float


def solve_compensation(x: np.ndarray, eps: np.ndarray) -> np.ndarray:
  """Theorem 3.1: the minimum-norm ``W [D, D]`` minimising ``||x W - eps||_F`` for ``x, eps [n, D]`` (pseudoinverse
  through the SVD, so a rank-deficient ``x``, e.g. fewer positions than D, still gives the unique min-norm W)."""
  return np.linalg.lstsq(np.asarray(x, np.float64), np.asarray(eps, np.float64), rcond=None)[0]


class _Accumulator:
  """Running sums for one layer's fit; see the module docstring."""

  def __init__(self, fit: str):
    self.fit, self.n = fit, 0
    self.x_sum = self.eps_sum = self.xtx = self.xte = 0.0

  def add(self, x: np.ndarray, eps: np.ndarray) -> None:
    """``x``, ``eps``: ``[B, T, D]``."""
    x, eps = np.asarray(x, np.float64), np.asarray(eps, np.float64)
    self.n += x.shape[0]
    self.x_sum = self.x_sum + x.sum(0)
    self.eps_sum = self.eps_sum + eps.sum(0)
    if self.fit == "tokens":
      flat_x, flat_e = x.reshape(-1, x.shape[-1]), eps.reshape(-1, eps.shape[-1])
      self.xtx = self.xtx + flat_x.T @ flat_x
      self.xte = self.xte + flat_x.T @ flat_e

  def solve(self, layer: int) -> CompensationFit:
    x_mean, eps_mean = self.x_sum / self.n, self.eps_sum / self.n
    w = solve_compensation(x_mean, eps_mean) if self.fit == "mean" else solve_compensation(self.xtx, self.xte)
    return CompensationFit(layer, w, float(np.linalg.norm(eps_mean)), float(np.linalg.norm(x_mean @ w - eps_mean)))


def _forward(graphdef: nnx.GraphDef) -> Callable:
  """``(params, batch) -> (summed token loss, token count, MHAActivations [L, B, T, D])``, jitted."""
  def fn(params, batch):
    logits, mha = nnx.merge(graphdef, params).capture_mha(batch.inputs, batch.positions, batch.segment_ids)
    return *masked_cross_entropy(logits, batch), mha
  return jax.jit(fn)


def calibrate_compensation(src: tuple[nnx.GraphDef, dict], dst: tuple[nnx.GraphDef, dict], schedule: Schedule,
                           batches: Iterable[dict[str, np.ndarray]], fit: str = "tokens"
                           ) -> tuple[dict, list[CompensationFit], dict[str, float]]:
  """Initialise every compensated layer's W_c of ``dst`` by Algorithm 1, bottom-up.

  Args:
    src: the original model ``(graphdef, params)`` (e.g. the dense model the UniAttn model was converted from).
    dst: the UniAttn model ``(graphdef, params)`` (pure dicts; its W_c are replaced, whatever they hold).
    schedule: ``dst``'s compiled schedule (which layers have W_c, and whether W_c reads Norm(x)).
    batches: calibration batches (``inputs``, ``targets``, ``positions``, ``segment_ids``, ``loss_mask``;
      ``[B, T]`` each), e.g. the first training batches (the paper samples its post-training set).
    fit: ``tokens`` (least squares over all tokens) or ``mean`` (Theorem 3.1 on sample means, the paper's).

  Returns:
    ``(dst params with fitted W_c, one CompensationFit per layer bottom-up, calibration loss in nats/token of the
    original model, of the UniAttn model before (W_c = 0) and after)``.

  Raises:
    ValueError: ``fit`` is invalid, ``batches`` is empty, or the schedule has no compensated layer.
  """
  fit = parse(WcFit, fit, "--wc-fit")
  layers = [p.index for p in schedule.layers if p.compensation]
  if not layers:
    raise ValueError(f"schedule {schedule.describe()} has no layer with UniAttn's compensation W_c")
  batches = list(batches)
  if not batches:
    raise ValueError("W_c calibration needs at least one batch")
  tokens = sum(float(b.loss_mask.sum()) for b in batches)
  params = jax.tree.map(jnp.asarray, dst[1])
  params = _set_wc(params, schedule, {l: None for l in layers})  # W_c = 0: "before"
  src_fn, dst_fn = _forward(src[0]), _forward(dst[0])
  original, loss_original = [], 0.0
  for batch in batches:
    s, _, mha = src_fn(src[1], batch)
    original.append(np.asarray(mha.output[np.asarray(layers)], np.float64))
    loss_original += float(s) / tokens
  fits, loss_before = [], None
  for position, layer in enumerate(layers):
    acc, total = _Accumulator(fit), 0.0
    for batch, ori in zip(batches, original):
      s, _, mha = dst_fn(params, batch)
      total += float(s)
      x = mha.normed[layer] if _reads_normed(schedule, layer) else mha.input[layer]
      acc.add(np.asarray(x), ori[position] - np.asarray(mha.output[layer], np.float64))
    if loss_before is None:
      loss_before = total / tokens
    fits.append(acc.solve(layer))
    params = _set_wc(params, schedule, {layer: fits[-1].kernel})
  loss_after = sum(float(dst_fn(params, b)[0]) for b in batches) / tokens
  return params, fits, {"original": loss_original, "unified": loss_before, "compensated": loss_after}


def _reads_normed(schedule: Schedule, layer: int) -> bool:
  """Whether the layer's W_c reads Norm(x) (``schedule.uniattn.wc_input=normed``) rather than the residual x."""
  s_idx, _, r_idx, _ = P.layer_location(schedule, layer)
  return schedule.stacks[s_idx].runs[r_idx].role.wc_normed


def _set_wc(params: dict, schedule: Schedule, kernels: dict[int, np.ndarray | None]) -> dict:
  """``params`` with the given layers' W_c set (None: zero)."""
  for layer, w in kernels.items():
    old = P.layer_params(params, schedule, layer)
    shape = old["compensation"]["kernel"].shape
    kernel = jnp.zeros(shape) if w is None else jnp.asarray(w, jnp.float32)
    params = P.replace_layer(params, schedule, layer, {**old, "compensation": {"kernel": kernel}})
  return params


def format_fits(fits: list[CompensationFit], losses: dict[str, float], fit: str) -> list[str]:
  """Report lines: per layer the compensation error before -> after, and the calibration losses."""
  lines = [f"W_c by least squares on calibration batches (UniAttn Thm 3.1 / Alg. 1, bottom-up, fit={fit}):"]
  for f in fits:
    pct = 100 * f.error_after / f.error_before if f.error_before else 0.0
    lines.append(f"  layer {f.layer} compensation: error ||E(x)W_c - E(eps)|| {f.error_before:.4g} -> "
                 f"{f.error_after:.4g} ({pct:.1f}%)")
  lines.append(f"  calibration loss: original {losses['original']:.4f}, unified {losses['unified']:.4f}, "
               f"with W_c {losses['compensated']:.4f} nats/token")
  return lines
