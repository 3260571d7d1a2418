"""Evaluate a run directory or checkpoint: loss, perplexity, bits per byte, size, KV bytes, a greedy sample; the
perplexity of any text file or tfds dataset."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any

import grain
import jax
import numpy as np

from jaxshare.data import Datasets, TokenStream, WindowSource, load_documents
from jaxshare.data.batch import Batch
from jaxshare.evaluation.generate import Generator
from jaxshare.evaluation.val_loss import evaluate_loss, loss_sums, make_eval_step
from jaxshare.store.runs import load_run


def evaluate_run(path: str | Path, *, max_batches: int = 0, skip_batches: int = 0, prompt: str = "ROMEO:\n",
                 sample_tokens: int = 200) -> dict[str, Any]:
  """Evaluate the latest (or given) checkpoint of a run on its validation split, on one device: ``max_batches``
  global batches (0: all) after the first ``skip_batches`` (a search selects on those and reports on the rest).

  Returns:
    ``step``, ``val_loss`` (nats/token), ``perplexity``, ``bits_per_byte`` (these three None when the data has no
    validation split), ``num_params``,
    ``kv_bytes_per_token`` (cache in the compute dtype), ``kv_bytes_per_token_bf16``, ``sample``.

  Raises:
    ConfigError: bad path or saved config. CheckpointError: no, corrupt or mismatched checkpoint.
  """
  run = load_run(path)
  cfg = run.cfg
  data = Datasets(cfg.data, cfg.train.batch_size, process_index=0, process_count=1)
  loss = None  # data prepared without a validation split
  if data.has_validation:
    with jax.set_mesh(run.mesh):
      loss = evaluate_loss(jax.jit(make_eval_step(run.graphdef)), run.batch_sharding, run.params, data, max_batches,
                           skip_batches)
  sample_ids = []
  if sample_tokens:
    generator = Generator(run.model(), run.plan)
    sample_ids = generator.generate([data.tokenizer.encode(prompt)], sample_tokens)[0]
  kv_dtype_bytes = 2 if cfg.model.dtype == "bfloat16" else 4
  return {
    "run_dir": str(run.directory), "step": run.step, "schedule": run.schedule.describe(),
    "val_loss": loss, "perplexity": None if loss is None else math.exp(loss),
    "bits_per_byte": None if loss is None else loss / math.log(2) / data.bytes_per_token,
    "num_params": run.num_params,
    "kv_bytes_per_token": run.plan.kv_cache_bytes_per_token(kv_dtype_bytes),
    "kv_bytes_per_token_bf16": run.plan.kv_cache_bytes_per_token(2),
    "prompt": prompt, "sample": data.tokenizer.decode(sample_ids),
  }


def format_report(r: dict[str, Any]) -> str:
  """Human-readable evaluation summary."""
  scores = [f"  val loss          {r['val_loss']:.4f} nats/token", f"  perplexity        {r['perplexity']:.3f}",
            f"  bits per byte     {r['bits_per_byte']:.4f}"] if r["val_loss"] is not None else [
    "  val loss          none: the data has no validation split (python -m jaxshare.data prepare --val-docs N)"]
  return "\n".join([
    f"evaluation of {r['run_dir']} at step {r['step']}",
    f"  schedule          {r['schedule']}",
    *scores,
    f"  parameters        {r['num_params']:,}",
    f"  KV cache          {r['kv_bytes_per_token']:,} B/token ({r['kv_bytes_per_token_bf16']:,} in bf16)",
    "  greedy sample:",
    "    " + (r["prompt"] + r["sample"]).replace("\n", "\n    "),
  ])


def perplexity(path: str | Path, *, text: str | None = None, tfds_name: str | None = None, tfds_split: str = "test",
               tfds_data_dir: str = "", text_field: str = "text", max_batches: int = 0) -> dict[str, Any]:
  """Loss of a run on a text file or a tfds dataset (local only), with the run's tokenizer, in consecutive windows
  of the training ``seq_len`` (documents end with EOS; no token is predicted across documents).

  Returns:
    ``loss`` (nats/token), ``perplexity``, ``bits_per_byte`` (UTF-8 bytes of the scored text), ``tokens``.

  Raises:
    ValueError: neither or both of ``text`` and ``tfds_name``. DataError: missing, empty or malformed input, or too
      short for one window. ConfigError / CheckpointError: as :func:`evaluate_run`.
  """
  if (text is None) == (tfds_name is None):
    raise ValueError("perplexity needs exactly one of text (a file) and tfds_name")
  run = load_run(path)
  cfg = run.cfg
  source = dict(source="text", path=str(Path(text).resolve()), document_separator="") if text is not None else dict(
    source="tfds", tfds_name=tfds_name, tfds_split=tfds_split, tfds_data_dir=tfds_data_dir, text_field=text_field)
  data_cfg = dataclasses.replace(cfg.data, **source)
  tokenizer = run.tokenizer()
  stream = TokenStream.from_documents(load_documents(data_cfg), tokenizer)
  windows = WindowSource(stream, slice(0, len(stream.tokens)), cfg.data.seq_len, "scored text")
  batch = min(cfg.train.batch_size, len(windows))
  ds = grain.MapDataset.source(windows).batch(batch, drop_remainder=False)
  n = len(ds) if not max_batches else min(max_batches, len(ds))
  # the last batch may be short: pad it with fully masked rows (one compiled shape)
  batches = [jax.tree.map(lambda v: _pad_rows(v, batch), Batch.of(ds[i])) for i in range(n)]
  with jax.set_mesh(run.mesh):
    total, count = loss_sums(jax.jit(make_eval_step(run.graphdef)), run.batch_sharding, run.params, batches)
  scored = np.concatenate([b.targets[b.loss_mask == 1] for b in batches]).tolist()
  loss = total / max(count, 1.0)
  num_bytes = len(tokenizer.decode(scored).encode("utf-8"))
  return {"loss": loss, "perplexity": math.exp(loss), "bits_per_byte": total / math.log(2) / max(num_bytes, 1),
          "tokens": int(count)}


def _pad_rows(x: np.ndarray, rows: int) -> np.ndarray:
  return np.concatenate([x, np.zeros((rows - len(x), *x.shape[1:]), x.dtype)])
