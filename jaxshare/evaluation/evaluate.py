"""Evaluate a run directory or checkpoint: loss, perplexity, bits per byte, size, KV bytes, a greedy sample."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxshare import accounting
from jaxshare.data import Datasets
from jaxshare.train.loop import evaluate_loss
from jaxshare.train.state import load_run, locate
from jaxshare.train.step import make_eval_step


def greedy_sample(model: nnx.Module, prompt_ids: list[int], num_tokens: int, window: int) -> list[int]:
  """Greedy decoding by full forward passes over the last ``window`` tokens (one compiled shape).

  Args:
    model: a :class:`~jaxshare.model.Transformer`.
    prompt_ids: at least one token id.
    num_tokens: new tokens to generate.
    window: context length (the training ``seq_len``).

  Returns:
    The generated ids (without the prompt).
  """
  if not prompt_ids:
    raise ValueError("greedy_sample needs a non-empty prompt")
  graphdef, params = nnx.split(model)

  @jax.jit
  def next_token(params, buf, last):
    logits = nnx.merge(graphdef, params)(buf[None])
    return jnp.argmax(logits[0, last])

  ids = list(prompt_ids)
  for _ in range(num_tokens):
    ctx = ids[-window:]
    buf = np.zeros(window, np.int32)
    buf[:len(ctx)] = ctx
    ids.append(int(next_token(params, buf, len(ctx) - 1)))
  return ids[len(prompt_ids):]


def evaluate_run(path: str | Path, *, max_batches: int = 0, prompt: str = "ROMEO:\n",
                 sample_tokens: int = 200) -> dict[str, Any]:
  """Evaluate the latest (or given) checkpoint of a run on its validation split, on one device.

  Returns:
    ``step``, ``val_loss`` (nats/token), ``perplexity``, ``bits_per_byte``, ``num_params``,
    ``kv_bytes_per_token`` (cache in the compute dtype), ``kv_bytes_per_token_bf16``, ``sample``.

  Raises:
    ConfigError: bad path or saved config. CheckpointError: no, corrupt or mismatched checkpoint.
  """
  cfg, setup, params, step = load_run(path)
  run_dir, _ = locate(path)
  data = Datasets(cfg.data, cfg.train.batch_size, process_index=0, process_count=1)
  eval_fn = jax.jit(make_eval_step(setup.graphdef))
  with jax.set_mesh(setup.mesh):
    loss = evaluate_loss(eval_fn, setup, params, data, max_batches)
  model = nnx.merge(setup.graphdef, params)
  sample_ids = greedy_sample(model, data.tokenizer.encode(prompt), sample_tokens, cfg.data.seq_len)
  kv_dtype_bytes = 2 if cfg.model.dtype == "bfloat16" else 4
  return {
    "run_dir": str(run_dir), "step": step, "schedule": setup.schedule.describe(),
    "val_loss": loss, "perplexity": math.exp(loss), "bits_per_byte": loss / math.log(2) / data.bytes_per_token,
    "num_params": setup.num_params,
    "kv_bytes_per_token": accounting.kv_cache_bytes_per_token(cfg.model, setup.schedule, kv_dtype_bytes),
    "kv_bytes_per_token_bf16": accounting.kv_cache_bytes_per_token(cfg.model, setup.schedule, 2),
    "prompt": prompt, "sample": data.tokenizer.decode(sample_ids),
  }


def format_report(r: dict[str, Any]) -> str:
  """Human-readable evaluation summary."""
  return "\n".join([
    f"evaluation of {r['run_dir']} at step {r['step']}",
    f"  schedule          {r['schedule']}",
    f"  val loss          {r['val_loss']:.4f} nats/token",
    f"  perplexity        {r['perplexity']:.3f}",
    f"  bits per byte     {r['bits_per_byte']:.4f}",
    f"  parameters        {r['num_params']:,}",
    f"  KV cache          {r['kv_bytes_per_token']:,} B/token ({r['kv_bytes_per_token_bf16']:,} in bf16)",
    "  greedy sample:",
    "    " + (r["prompt"] + r["sample"]).replace("\n", "\n    "),
  ])
