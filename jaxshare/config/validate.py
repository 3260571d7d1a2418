"""Every check of a config's fields and field combinations, in one place; the sharing schedule itself is checked
when it is compiled (:mod:`jaxshare.schedule`)."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from jaxshare.config.schema import Config, ConfigError, mixture_name


def _require(cond: bool, field: str, value: Any, allowed: str) -> None:
  if not cond:
    raise ConfigError(f"{field}={value!r} is invalid: {allowed}")


def _leaf_fields(obj: Any, prefix: str = ""):
  """``(dotted name, dataclasses.Field, value)`` for every field that is not a group, nested groups included."""
  for f in dataclasses.fields(obj):
    value = getattr(obj, f.name)
    if dataclasses.is_dataclass(value):
      yield from _leaf_fields(value, f"{prefix}{f.name}.")
    else:
      yield f"{prefix}{f.name}", f, value


def _check_context(cfg: Config) -> None:
  """Context parallelism's demands on the rest of the config (refused before any compile)."""
  c = cfg.mesh.context_size
  if c == 1:
    return
  _require(c == 0 or cfg.data.seq_len % (2 * c) == 0, "data.seq_len", cfg.data.seq_len,
           f"must be a multiple of 2 x the context axis ({2 * c}: mesh.context={cfg.mesh.context} x "
           f"mesh.dcn_context={cfg.mesh.dcn_context}), which splits every sequence into two chunks per device")
  _require(cfg.attention.score_sharing == "recompute", "attention.score_sharing", cfg.attention.score_sharing,
           "must be recompute with mesh.context > 1 (materialize hands on [B, H, T, T] tensors, which context "
           "parallelism exists to avoid)")
  _require(cfg.train.kd_beta == 0, "train.kd_beta", cfg.train.kd_beta,
           "must be 0 with mesh.context > 1 (distillation compares [L, B, H, T, T] attention logits, which context "
           "parallelism never materialises)")


def validate(cfg: Config) -> None:
  """Check every field and field combination; the schedule itself is checked by :mod:`jaxshare.schedule`.

  Raises:
    ConfigError: naming the first invalid field, its value and what is allowed.
  """
  for name, f, value in _leaf_fields(cfg):
    if choices := f.metadata.get("choices"):
      _require(value in choices, name, value, f"must be one of {', '.join(map(str, choices))}")
  m, d, t = cfg.model, cfg.data, cfg.train
  for name in ("vocab_size", "num_layers", "d_model", "num_heads", "mlp_dim"):
    _require(getattr(m, name) > 0, f"model.{name}", getattr(m, name), "must be a positive integer")
  _require(m.head_dim >= 0, "model.head_dim", m.head_dim, "must be >= 0 (0: d_model // num_heads)")
  _require(m.head_dim > 0 or m.d_model % m.num_heads == 0, "model.num_heads", m.num_heads,
           f"must divide model.d_model={m.d_model} when model.head_dim=0")
  _require(0.0 < m.rotary_pct <= 1.0, "model.rotary_pct", m.rotary_pct, "must be in (0, 1]")
  rot = int(m.resolved_head_dim * m.rotary_pct)
  _require(rot % 2 == 0 and rot > 0, "model.rotary_pct", m.rotary_pct,
           f"must rotate an even, positive number of the {m.resolved_head_dim} head dims (got {rot}; head dims: "
           f"model.head_dim={m.head_dim}, or model.d_model={m.d_model} // model.num_heads={m.num_heads} when 0)")
  _require(m.rope_theta > 0, "model.rope_theta", m.rope_theta, "must be > 0")
  _require(m.sliding_window >= 0, "model.sliding_window", m.sliding_window, "must be >= 0 (0: no window)")
  _require(m.rope_scaling_factor > 0, "model.rope_scaling_factor", m.rope_scaling_factor, "must be > 0")
  _require(m.rope_scaling != "llama3" or m.rope_high_freq_factor > m.rope_low_freq_factor > 0,
           "model.rope_high_freq_factor", m.rope_high_freq_factor,
           f"llama3 scaling needs rope_high_freq_factor > rope_low_freq_factor={m.rope_low_freq_factor} > 0")
  _require(m.rope_original_max_positions > 0, "model.rope_original_max_positions", m.rope_original_max_positions,
           "must be > 0")
  for name in ("init_std", "norm_eps", "rope_theta", "rope_scaling_factor"):
    v = getattr(m, name)
    _require(math.isfinite(v) and v > 0, f"model.{name}", v, "must be a finite number > 0")
  _require(cfg.schedule.match_reference_params >= 0, "schedule.match_reference_params",
           cfg.schedule.match_reference_params, "must be >= 0 (0: the dense MHA model of this config)")
  lisa = cfg.schedule.lisa
  _require(lisa.rank >= 0, "schedule.lisa.rank", lisa.rank, "must be >= 0 (>= 1 unless every LISA layer is DS)")
  _require(lisa.hidden >= 0, "schedule.lisa.hidden", lisa.hidden, "must be >= 0 (0: 8 * model.num_heads)")
  _require(d.seq_len > 0, "data.seq_len", d.seq_len, "must be a positive integer")
  _require(0 <= d.shuffle_seed < 2**32, "data.shuffle_seed", d.shuffle_seed,
           "must be in [0, 2**32) (the shuffle's seed is unsigned 32-bit)")
  _require(0.0 < d.val_fraction < 1.0, "data.val_fraction", d.val_fraction, "must be in (0, 1)")
  _require(d.source != "tfds" or bool(d.tfds_name), "data.tfds_name", d.tfds_name,
           "must name a dataset when data.source=tfds")
  _require(not d.mixture or d.source == "prepared", "data.mixture", d.mixture,
           "needs data.source=prepared (a mixture of prepared directories)")
  for n, entry in enumerate(d.mixture):
    _require(isinstance(entry, dict) and isinstance(entry.get("path"), str) and bool(entry.get("path"))
             and set(entry) <= {"path", "weight", "name"}, f"data.mixture[{n}]", entry,
             "must be {path: DIR, weight: W} with an optional name")
    weight = entry.get("weight")
    _require(isinstance(weight, (int, float)) and not isinstance(weight, bool) and math.isfinite(weight)
             and weight > 0, f"data.mixture[{n}].weight", weight, "must be a finite number > 0")
  names = [mixture_name(e) for e in d.mixture]
  _require(len(set(names)) == len(names), "data.mixture", names, "names its components twice (give each a name)")
  for name in ("steps", "batch_size", "grad_accum_steps", "log_every", "checkpoint_every", "keep_checkpoints"):
    _require(getattr(t, name) > 0, f"train.{name}", getattr(t, name), "must be a positive integer")
  _require(t.num_vocab_tiling >= 1 and m.vocab_size % t.num_vocab_tiling == 0, "train.num_vocab_tiling",
           t.num_vocab_tiling, f"must be a positive divisor of model.vocab_size={m.vocab_size}")
  _require(t.batch_size % t.grad_accum_steps == 0, "train.grad_accum_steps", t.grad_accum_steps,
           f"must divide train.batch_size={t.batch_size}")
  _require(-2**63 <= t.seed < 2**63, "train.seed", t.seed, "must be a signed 64-bit integer")
  _require(math.isfinite(t.storage_patience_s) and t.storage_patience_s >= 0, "train.storage_patience_s",
           t.storage_patience_s, "must be a finite number of seconds >= 0")
  _require(t.peak_tflops >= 0, "train.peak_tflops", t.peak_tflops, "must be >= 0 (0: the device's known peak)")
  _require(math.isfinite(t.lr) and t.lr > 0, "train.lr", t.lr, "must be a finite number > 0")
  for name in ("b1", "b2"):
    _require(0.0 <= getattr(t, name) < 1.0, f"train.{name}", getattr(t, name), "must be in [0, 1)")
  _require(math.isfinite(t.eps) and t.eps > 0, "train.eps", t.eps, "must be a finite number > 0")
  for name in ("weight_decay", "clip_norm", "postshare_gamma"):
    v = getattr(t, name)
    _require(math.isfinite(v) and v >= 0, f"train.{name}", v, "must be a finite number >= 0")
  _require(0 <= t.warmup_steps < t.steps, "train.warmup_steps", t.warmup_steps,
           f"must be in [0, train.steps={t.steps})")
  _require(0.0 <= t.min_lr_ratio <= 1.0, "train.min_lr_ratio", t.min_lr_ratio, "must be in [0, 1]")
  _require(t.eval_every >= 0, "train.eval_every", t.eval_every, "must be >= 0 (0: no periodic validation)")
  _require(t.eval_batches >= 0, "train.eval_batches", t.eval_batches, "must be >= 0 (0: the whole split)")
  _require(0.0 <= t.kd_beta <= 1.0, "train.kd_beta", t.kd_beta, "must be in [0, 1]")
  _require(t.kd_beta == 0 or bool(t.init_from or t.kd_teacher), "train.kd_beta", t.kd_beta,
           "distillation needs a teacher: set train.kd_teacher or train.init_from")
  _require(math.isfinite(t.kd_delta) and t.kd_delta > 0, "train.kd_delta", t.kd_delta, "must be a finite number > 0")
  _require(0.0 < t.postshare_ratio < 0.75, "train.postshare_ratio", t.postshare_ratio, "must be in (0, 0.75)")
  for name in ("stage1_max_steps", "stage1_patience"):
    _require(getattr(t, name) > 0, f"train.{name}", getattr(t, name), "must be a positive integer")
  _require(0.0 < t.stage1_ema < 1.0, "train.stage1_ema", t.stage1_ema, "must be in (0, 1)")
  _require(t.stage2_steps >= 0, "train.stage2_steps", t.stage2_steps, "must be >= 0 (0: the rest of train.steps)")
  _require(t.stage2_steps == 0 or t.recipe == "uniattn_two_stage", "train.stage2_steps", t.stage2_steps,
           "needs train.recipe=uniattn_two_stage (or 0)")
  _require(t.stage2_steps == 0 or t.steps >= t.stage1_max_steps + t.stage2_steps, "train.steps", t.steps,
           f"must be >= train.stage1_max_steps + train.stage2_steps = {t.stage1_max_steps + t.stage2_steps} (the "
           "longest the two-stage run can take)")
  _require(t.recipe != "uniattn_two_stage" or t.trainable == "all", "train.trainable", t.trainable,
           "must be all with train.recipe=uniattn_two_stage (stage 1 trains W_c alone, stage 2 fine-tunes everything)")
  for name in ("data", "fsdp", "context", "tensor"):
    v = getattr(cfg.mesh, name)
    _require(v == -1 or v >= 1, f"mesh.{name}", v, "must be a positive axis size or -1 (fill)")
  _require([cfg.mesh.data, cfg.mesh.fsdp, cfg.mesh.context, cfg.mesh.tensor].count(-1) <= 1, "mesh", "-1 twice",
           "at most one mesh axis may be -1")
  for name in ("dcn_data", "dcn_fsdp", "dcn_context", "dcn_tensor"):
    _require(getattr(cfg.mesh, name) >= 1, f"mesh.{name}", getattr(cfg.mesh, name), "must be a positive axis size")
  _check_context(cfg)
  dist = cfg.distributed
  _require(dist.num_processes >= 0, "distributed.num_processes", dist.num_processes, "must be >= 0 (0: auto-detected)")
  _require(dist.process_id >= -1 and (dist.num_processes == 0 or dist.process_id < dist.num_processes),
           "distributed.process_id", dist.process_id,
           f"must be in [0, distributed.num_processes={dist.num_processes}) or -1 (auto-detected)")
  _require(not dist.coordinator_address or (":" in dist.coordinator_address and dist.num_processes > 0
                                            and dist.process_id >= 0),
           "distributed.coordinator_address", dist.coordinator_address,
           "must be host:port, with distributed.num_processes and distributed.process_id set")
  _require(dist.timeout_s > 0, "distributed.timeout_s", dist.timeout_s, "must be > 0")
  _require(all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in dist.local_device_ids),
           "distributed.local_device_ids", dist.local_device_ids, "must list device ids (integers >= 0), e.g. [0]")
  for name, _, value in _leaf_fields(cfg):  # nan or inf is never a setting, even of a field the run ignores
    if isinstance(value, float):
      _require(math.isfinite(value), name, value, "must be a finite number")
