"""Uptraining conversions: a trained (e.g. dense) model's parameters into a sharing schedule's.

K/V sharing: each producer layer's K/V projections from the source's.

Every target layer that projects K/V (a producer) serves a group of reader layers (itself and its consumers). Its
``k_proj`` / ``v_proj`` kernels and biases are built from the source's projections of exactly those layers:

- heads: the source's H heads mean-pooled into the target's G groups of H/G consecutive heads (GQA, Ainslie et al.
  2023, Sec. 2.1: "the key and value head for each group is constructed by mean-pooling all the original heads
  within that group"; MQA is G = 1);
- layers: the group's head-pooled projections combined by ``kv_pool``: ``mean`` (uniform mean over the group, MLKV
  Sec. 3) or ``running`` (pythia-mlkv's conversion script: a running pairwise mean ``acc = (acc + w_l) / 2`` over the
  group's layers in order, which weights the last layer by 1/2 and the first by 1/2^(n-1)), or ``producer`` (CLA:
  the producer layer's own projection, the consumers' dropped).

MLP widening (``schedule.match_params``, MLKV's parameter matching): the first F neurons of each widened MLP are the
source's; the F' - F new ones follow ``train.init_mlp_widen``: ``duplicate`` (pythia-mlkv's conversion script: copies
of the source's first F' - F neurons, in- and out-weights and biases, so their contribution doubles and the function
changes) or ``zero`` (fresh input weights, zero output rows: the widened MLP computes exactly the source's function,
and the new neurons still learn, since their output rows receive gradients).

LISA's new modules (:func:`init_low_rank`): the low-rank ``k_lr`` starts at zero, so ``A_delta = Q_lr K_lr^T = 0``
and, with the aligners' identity-on-``A_{n-1}`` initialisation (:func:`jaxshare.model.attention.sum_aligner`), every
LISA layer starts as DS, the exact reuse of the previous layer's logits that the papers evaluate untrained (LISA's
DS rows; UniAttn's unification without W_c). This start is jaxshare's choice: LISA prescribes no initialisation for
a conversion, and its analysis shows plain reuse is what does not work untrained. A random ``A_delta`` would add noise carrying nothing about the source;
an SVD of the layer's own ``W_q W_k^T`` approximates its logits, not the difference to the reused ones, and is not
position-independent under RoPE. As in LoRA's zero-initialised factor, ``q_lr`` stays random so that ``k_lr``
receives gradients from the first step (``dL/dK_lr = Q_lr^T dL/dA_delta``).

Everything else is copied where the source has the same layer, name and shape (:func:`copy_shared_weights`).
:func:`init_report` names the rule used for every target parameter and lists the ones that keep their fresh
initialisation.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxshare.config import LISA_STARTS, ConfigError
from jaxshare.model import params as P
from jaxshare.schedule import Schedule

KV_POOLS = ("mean", "running", "producer")
MLP_WIDENS = ("zero", "duplicate")
_KV = ("k_proj", "v_proj")


def pool_heads(x: jax.Array, groups: int) -> jax.Array:
  """``[..., H, d]`` -> ``[..., G, d]``: the mean of each group of H/G consecutive heads (query head h reads K/V
  group ``h // (H/G)``, as in :mod:`jaxshare.kernels.reference`).

  Raises:
    ValueError: G does not divide H.
  """
  h, d = x.shape[-2:]
  if h % groups:
    raise ValueError(f"cannot mean-pool {h} K/V heads into {groups} groups: {groups} must divide {h}")
  return x.reshape(*x.shape[:-2], groups, h // groups, d).mean(-2)


def combine_layers(xs: list[jax.Array], kv_pool: str) -> jax.Array:
  """Combine one group's per-layer projections (in layer order) by ``kv_pool`` (see the module docstring)."""
  if kv_pool == "producer":
    return xs[0]
  if kv_pool == "mean":
    return sum(xs[1:], xs[0]) / len(xs)
  if kv_pool == "running":
    acc = xs[0]
    for x in xs[1:]:
      acc = (acc + x) / 2
    return acc
  raise ValueError(f"kv_pool={kv_pool!r} is invalid: must be one of {', '.join(KV_POOLS)}")


def reader_groups(schedule: Schedule) -> dict[int, list[int]]:
  """``{producer layer: [layers attending with its K/V, in order]}``."""
  groups: dict[int, list[int]] = {}
  for plan in schedule.layers:
    groups.setdefault(plan.kv_source, []).append(plan.index)
  return groups


def convertible_groups(src_schedule: Schedule, dst_schedule: Schedule) -> dict[int, list[int]]:
  """The target's reader groups whose every layer projects its own K/V in the source (and whose head counts
  divide): those :func:`convert_kv` builds; any other producer keeps its fresh initialisation."""
  src = {p.index: p for p in src_schedule.layers}
  return {producer: readers for producer, readers in reader_groups(dst_schedule).items()
          if all(src[r].kv_source == r and src[r].num_kv_heads % dst_schedule.layers[producer].num_kv_heads == 0
                 for r in readers)}


def convert_kv(src: dict, src_schedule: Schedule, dst: dict, dst_schedule: Schedule, *, kv_pool: str = "mean"
               ) -> dict:
  """``dst`` with every producer's ``k_proj`` / ``v_proj`` (kernel and bias) pooled from ``src``. Traceable.

  Only :func:`convertible_groups` are converted; the report says which are not.
  """
  out = dst
  for producer, readers in convertible_groups(src_schedule, dst_schedule).items():
    layer = P.layer_params(out, dst_schedule, producer)
    attn = dict(layer["attn"])
    for m in (m for m in _KV if m in attn):  # probability reusers project V only
      leaves = {}
      for leaf, target in attn[m].items():
        per_layer = []
        for r in readers:
          source = P.layer_params(src, src_schedule, r)["attn"][m][leaf].astype(jnp.float32)
          per_layer.append(pool_heads(source, target.shape[-2]))
        leaves[leaf] = combine_layers(per_layer, kv_pool).astype(target.dtype)
      attn[m] = leaves
    out = P.replace_layer(out, dst_schedule, producer, {**layer, "attn": attn})
  return out


def widen_mlp(src: dict, src_schedule: Schedule, dst: dict, dst_schedule: Schedule, *, rule: str = "zero") -> dict:
  """``dst`` with every MLP of another width than the source's built from it: wider (F' > F hidden units) by ``rule``
  (see the module docstring; ``duplicate`` repeats the source's neurons cyclically when F' > 2F), narrower (a matched
  model that adds parameters elsewhere, or a target larger than its GQA source) from the source's first F' units.
  Traceable.

  Raises:
    ValueError: ``rule`` is invalid.
  """
  if rule not in MLP_WIDENS:
    raise ValueError(f"train.init_mlp_widen={rule!r} is invalid: must be one of {', '.join(MLP_WIDENS)}")
  out = dst
  for layer in range(len(dst_schedule.layers)):
    s_mlp = P.layer_params(src, src_schedule, layer)["mlp"]
    d_layer = P.layer_params(out, dst_schedule, layer)
    f, f_new = s_mlp["up"]["kernel"].shape[-1], d_layer["mlp"]["up"]["kernel"].shape[-1]
    if f_new == f:
      continue
    if f_new < f:
      mlp = {name: {leaf: jax.lax.slice_in_dim(s_mlp[name][leaf], 0, f_new, axis=0 if name == "down" else -1)
                    if s_mlp[name][leaf].shape != target.shape else s_mlp[name][leaf]
                    for leaf, target in proj.items()} for name, proj in d_layer["mlp"].items()}
      out = P.replace_layer(out, dst_schedule, layer, {**d_layer, "mlp": mlp})
      continue
    extra = jnp.arange(f_new - f) % f
    mlp = {}
    for name, proj in d_layer["mlp"].items():
      leaves = {}
      for leaf, target in proj.items():
        source = s_mlp[name][leaf]
        hidden_axis = 0 if name == "down" else -1  # [D, F] in, [F, D] out; biases [F] in, [D] out
        if source.shape == target.shape:
          leaves[leaf] = source
          continue
        if rule == "duplicate":
          new = jnp.take(source, extra, axis=hidden_axis)
        elif name == "down":
          new = jnp.zeros((f_new - f, *source.shape[1:]), source.dtype)
        else:
          new = jax.lax.slice_in_dim(target, f, f_new, axis=hidden_axis)
        leaves[leaf] = jnp.concatenate([source, new.astype(source.dtype)], axis=hidden_axis)
      mlp[name] = leaves
    out = P.replace_layer(out, dst_schedule, layer, {**d_layer, "mlp": mlp})
  return out


def widened_layers(src: dict, src_schedule: Schedule, dst: dict, dst_schedule: Schedule) -> dict[int, tuple[int, int]]:
  """``{layer: (F, F')}`` for the layers whose MLP :func:`widen_mlp` resizes (shapes only)."""
  def width(params, schedule, layer):
    return jax.eval_shape(lambda: P.layer_params(params, schedule, layer)["mlp"]["up"]["kernel"]).shape[-1]
  out = {}
  for layer in range(len(dst_schedule.layers)):
    f, f_new = width(src, src_schedule, layer), width(dst, dst_schedule, layer)
    if f_new != f:
      out[layer] = (f, f_new)
  return out


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
  the module docstring). ``fit``: ``q_lr``, ``k_lr`` from :func:`~jaxshare.convert.lisa_start.fit_low_rank` on the
  source's W_q, W_k of the layer and its score source (layers without them start as ``ds``). Traceable.

  Raises:
    ValueError: ``start`` is invalid.
  """
  from jaxshare.convert.lisa_start import fit_low_rank

  if start not in LISA_STARTS:
    raise ValueError(f"train.init_lisa={start!r} is invalid: must be one of {', '.join(LISA_STARTS)}")
  fittable = fittable_lisa_layers(src, src_schedule, dst_schedule) if start == "fit" else []
  out = dst
  for plan in dst_schedule.layers:
    layer = P.layer_params(out, dst_schedule, plan.index)
    if "k_lr" not in layer["attn"] or _same_shapes(P.layer_params(src, src_schedule, plan.index)["attn"].get("k_lr"),
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


def _same_shapes(a, b) -> bool:
  return a is not None and jax.tree.structure(a) == jax.tree.structure(b) and all(
    x.shape == y.shape for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def kv_report(src_schedule: Schedule, dst_schedule: Schedule, kv_pool: str) -> list[str]:
  """One line per target producer layer saying how its K/V were built (static: shapes and schedules only)."""
  h_src = {p.index: p.num_kv_heads for p in src_schedule.layers}
  ok = convertible_groups(src_schedule, dst_schedule)
  lines = []
  for producer, readers in reader_groups(dst_schedule).items():
    if producer not in ok:
      lines.append(f"layer {producer} k_proj/v_proj: NEW (fresh initialisation): the source does not project K/V "
                   f"in every layer of {readers} with a head count divisible by the target's")
      continue
    g = dst_schedule.layers[producer].num_kv_heads
    heads = f"{h_src[readers[0]]} -> {g} heads (mean of groups)" if h_src[readers[0]] != g else f"{g} heads"
    how = {"mean": f"mean over layers {readers}", "running": f"running pairwise mean over layers {readers}",
           "producer": f"layer {producer}'s own (its readers {readers})"}[kv_pool] if len(readers) > 1 \
      else f"from layer {producer}"
    lines.append(f"layer {producer} k_proj/v_proj: {how}, {heads}")
  return lines


def init_report(src: dict, src_schedule: Schedule, dst: dict, dst_schedule: Schedule, kv_pool: str,
                mlp_widen: str = "zero", wc_fitted: bool = False, lisa_start: str = "ds") -> list[str]:
  """How each parameter of ``dst`` was initialised from ``src`` (shapes only, nothing computed): the number copied
  unchanged, one line per K/V producer (:func:`kv_report`), the widened MLPs, LISA's zeroed ``k_lr``, and every
  parameter left at its fresh initialisation (UniAttn's W_c excepted when ``wc_fitted``: the calibration reports
  those)."""
  converted = convertible_groups(src_schedule, dst_schedule)
  widened = widened_layers(src, src_schedule, dst, dst_schedule)
  fitted = set(fittable_lisa_layers(src, src_schedule, dst_schedule)) if lisa_start == "fit" else set()
  low_rank = []
  copied, new = 0, []
  for key in dst:
    if key == "segments":
      continue
    same = _same_shapes(src.get(key), dst[key])
    copied, new = (copied + len(jax.tree.leaves(dst[key])), new) if same else (copied, new + [key])
  for layer in range(len(dst_schedule.layers)):
    d = _shapes(jax.eval_shape(lambda: P.layer_params(dst, dst_schedule, layer)))
    s = _shapes(jax.eval_shape(lambda: P.layer_params(src, src_schedule, layer)))
    for path, shape in d.items():
      if path.split("/")[:2] in (["attn", "k_proj"], ["attn", "v_proj"]) and layer in converted:
        continue
      if (path.startswith("mlp/") and layer in widened) or (path.startswith("compensation/") and wc_fitted):
        continue
      if s.get(path) == shape:
        copied += 1
      elif layer in fitted and path.split("/")[1] in ("q_lr", "k_lr"):
        continue
      elif path.startswith("attn/k_lr/"):
        low_rank.append(layer)
      else:
        new.append(f"layer {layer} {path}")
  lines = [f"{copied} tensors copied (same layer, name and shape)", *kv_report(src_schedule, dst_schedule, kv_pool)]
  how = {"zero": "new neurons: fresh input weights, zero output rows (same function)",
         "duplicate": "new neurons: copies of the first ones (pythia-mlkv)"}[mlp_widen]
  lines += [f"layer {layer} mlp: widened {f} -> {f_new} hidden units, the first {f} copied; {how}" if f_new > f else
            f"layer {layer} mlp: narrowed {f} -> {f_new} hidden units, the first {f_new} copied"
            for layer, (f, f_new) in widened.items()]
  if low_rank:
    lines.append(f"layers {sorted(set(low_rank))} attn/k_lr: zero (LISA's A_delta = 0: each starts as DS, the "
                 "previous layer's logits; q_lr random, aligners identity on A_(n-1))")
  if fitted:
    lines.append(f"layers {sorted(fitted)} attn/q_lr, k_lr: fitted, the rank-r truncated SVD of the source layer's "
                 "W_q W_k^T minus its score source's (A_(n-1) + A_delta approximates the layer's own logits; "
                 "jaxshare/convert/lisa_start.py)")
  if new:
    lines.append(f"NEW (fresh initialisation): {', '.join(new)}")
  return lines


def _shapes(tree: dict) -> dict[str, tuple[int, ...]]:
  return {path: tuple(v.shape) for path, v in P.flat_leaves(tree).items()}


def uptrain_run(src_run, out_run, overrides, *, calibration_batches: int = 8, wc_fit: str = "tokens",
                lisa_steps: int = 200) -> list[str]:
  """Convert a run into another schedule and write it as a new run directory (step 0); returns the report lines.

  The target config is the source's with ``overrides`` applied (``train.init_from`` set to the source), its
  parameters those ``train.py`` would start from with ``train.init_from``, except what is fitted on the first
  ``calibration_batches`` training batches: UniAttn's W_c by least squares (:mod:`jaxshare.convert.calibrate`; 0
  batches keep them at zero), and with ``train.init_lisa=calibrated`` LISA's low-rank factors, from the ``fit``
  start by ``lisa_steps`` Adam steps (:func:`~jaxshare.convert.lisa_start.calibrate_low_rank`).

  Raises:
    ConfigError / CheckpointError: unreadable source or invalid overrides, or ``train.init_lisa=calibrated`` with
      no calibration batches. DataError: the calibration data cannot be read. ValueError: invalid ``wc_fit``.
      FileExistsError: ``out_run`` not empty.
  """
  import itertools

  from jaxshare.config import apply_overrides
  from jaxshare.convert.calibrate import calibrate_compensation, format_fits
  from jaxshare.convert.lisa_start import calibrate_low_rank
  from jaxshare.convert.run_dir import write_run
  from jaxshare.data import Datasets
  from jaxshare.train.state import init_kv_pool, init_state, load_run, setup_run, with_match_reference

  src_cfg, src_setup, src_params, step = load_run(src_run)
  # the source's own reference (if it was matched) is not the target's: the target is matched to the source
  cfg = with_match_reference(apply_overrides(src_cfg, ["schedule.match_reference_params=0", *overrides,
                                                       f"train.init_from={src_run}"]))
  start = "fit" if cfg.train.init_lisa == "calibrated" else cfg.train.init_lisa  # calibrated starts from fit
  setup = setup_run(apply_overrides(cfg, [f"train.init_lisa={start}"]))
  lisa_calibrated = cfg.train.init_lisa == "calibrated" and any(p.has_low_rank for p in setup.schedule.layers)
  fitted = fittable_lisa_layers(src_params, src_setup.schedule, setup.schedule) if lisa_calibrated else []
  if lisa_calibrated and not fitted:
    raise ConfigError("train.init_lisa=calibrated: no LISA layer of the target has its own W_q and W_k, and its "
                      "score source's, in the source model to start from; use train.init_lisa=ds")
  if lisa_calibrated and not calibration_batches:
    raise ConfigError("train.init_lisa=calibrated needs calibration batches: --calibration-batches must be >= 1")
  params = init_state(setup, from_params=(src_params, src_setup.schedule))["params"]
  calibrate = bool(calibration_batches) and any(p.compensation for p in setup.schedule.layers)
  lines = init_report(src_params, src_setup.schedule, params, setup.schedule, init_kv_pool(cfg),
                      cfg.train.init_mlp_widen, wc_fitted=calibrate, lisa_start=start) \
    if setup.ties is None else ["head-wise sharing: DirectShare's tying of the source's heads (jaxshare/headwise.py)"]
  if calibrate or lisa_calibrated:
    data = Datasets(cfg.data, cfg.train.batch_size, process_index=0, process_count=1)
    batches = list(itertools.islice(data.train_iter(), calibration_batches))
  if calibrate:
    params, fits, losses = calibrate_compensation((src_setup.graphdef, src_params), (setup.graphdef, params),
                                                  setup.schedule, batches, fit=wc_fit)
    lines += format_fits(fits, losses, wc_fit)
  if lisa_calibrated:
    params, fit = calibrate_low_rank((src_setup.graphdef, src_params), (setup.graphdef, params), setup.schedule,
                                     batches, fitted, window=cfg.model.sliding_window, steps=lisa_steps)
    outcome = "no better: the fit kept" if fit.kept_start else "calibrated"
    lines.append(f"layers {list(fit.layers)} attn/q_lr, k_lr: {lisa_steps} Adam steps from the fit on "
                 f"{len(batches)} calibration batches: squared logit error vs the source's own, relative to plain "
                 f"reuse (DS = 1): fit {fit.start:.4f} -> {outcome} {fit.calibrated:.4f}")
  write_run(out_run, cfg, params, meta={"uptrained_from": str(src_run), "source_step": step})
  return [f"{src_setup.schedule.describe()} -> {setup.schedule.describe()}", *lines, f"written to {out_run}"]
