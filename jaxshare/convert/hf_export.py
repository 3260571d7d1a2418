"""A jaxshare run as a Hugging Face directory.

Dense and GQA models of the llama and neox flavours become ``LlamaForCausalLM`` / ``GPTNeoXForCausalLM`` directories
(``config.json``, ``model.safetensors`` or shards with an index, the run's tokenizer files: a byte-level run's as
:mod:`jaxshare.convert.byte_tokenizer` writes them) that ``transformers.AutoModelForCausalLM
.from_pretrained`` loads offline. Any other schedule becomes a remote-code directory (:mod:`jaxshare.convert.remote`)
that transformers loads with ``trust_remote_code=True`` and jaxshare reads back bit-exactly.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterable
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

from jaxshare.config import to_yaml
from jaxshare.convert import remote
from jaxshare.convert.byte_tokenizer import write_byte_tokenizer
from jaxshare.convert.hf_checkpoint import INDEX_FILE, SINGLE_FILE, TOKENIZER_FILES
from jaxshare.convert.hf_import import dims
from jaxshare.convert.llama import LLAMA
from jaxshare.convert.mapping import params_to_hf
from jaxshare.convert.neox import NEOX
from jaxshare.data.tokenizers import local_tokenizer_dir
from jaxshare.model.ties import HeadTies
from jaxshare.store.runs import load_run
from jaxshare.plan import ModelPlan

DEFAULT_SHARD_BYTES = 5 * 10 ** 9  # save_pretrained's long-standing max_shard_size="5GB"


def hf_incompatibility(plan: ModelPlan) -> str | None:
  """Why no HF class can hold the model of ``plan`` (None when one can): any layer reusing K/V or scores, UniAttn's
  W_c, tied heads, per-layer K/V head counts, a llama model with the parallel residual, or a neox model with GQA or
  a head width other than D/H."""
  schedule = plan.schedule
  plans = schedule.layers
  if schedule.tied_heads:
    return "head-wise sharing ties heads across layers"
  if any(p.kv_source != p.index for p in plans):
    return "layers read another layer's K/V"
  if any(p.score_reuse or p.compensation for p in plans):
    return "layers reuse attention scores"
  heads = {p.num_kv_heads for p in plans}
  if len(heads) > 1:
    return f"layers have different K/V head counts {sorted(heads)}"
  m = plan.model
  if m.flavor == "llama" and m.features.parallel_residual:
    return "Llama has no parallel residual"
  if m.sliding_window and m.features.qkv_biases:
    return "only Mistral has a sliding window in every layer, and it has neither biases nor GPT-NeoX blocks"
  if m.flavor == "neox" and (heads != {m.num_heads} or m.resolved_head_dim * m.num_heads != m.d_model):
    return "GPT-NeoX has neither GQA nor a head width other than hidden_size / num_heads"
  return None


def export_params(plan: ModelPlan, params: dict, out_dir: str | Path, *, config_yaml: str, seq_len: int,
                  ties: HeadTies | None = None, tokenizer_dir: str | Path | None = None, progress: bool = False,
                  max_shard_bytes: int = DEFAULT_SHARD_BYTES) -> str:
  """Write ``params``, the parameters of the model of ``plan``, as an HF directory; returns the
  ``architectures[0]`` written.

  Args:
    config_yaml: the run's config (:func:`~jaxshare.config.to_yaml`), which a remote-code directory carries for a
      bit-exact import.
    seq_len: the training sequence length (tokens), from which ``max_position_embeddings`` follows.
    ties: head-wise sharing's ties (written into a remote-code directory's ``config.json``).
    progress: a bar over the layers.
    max_shard_bytes: weights above this size are split into ``model-0000i-of-0000n.safetensors`` shards plus
      ``model.safetensors.index.json`` (as ``save_pretrained`` does); one layer's tensors are converted and held
      at a time, so the export needs the parameters plus about one shard of memory.

  Raises:
    FileExistsError: ``out_dir`` exists and is not empty. ValueError: ``ties`` given when the schedule ties no heads
      or missing when it ties some (the directory could not be imported again).
  """
  schedule = plan.schedule
  if bool(schedule.tied_heads) != (ties is not None):
    raise ValueError(f"the schedule ties {schedule.tied_heads} heads: export_params needs head-wise ties exactly when "
                     "it ties any")
  out = Path(out_dir)
  if out.exists() and any(out.iterdir()):
    raise FileExistsError(f"output directory {str(out)!r} exists and is not empty; choose a new one")
  out.mkdir(parents=True, exist_ok=True)
  if hf_incompatibility(plan) is None:
    arch = LLAMA if plan.model.flavor == "llama" else NEOX
    groups = params_to_hf(arch, plan, dims(plan), params, progress=progress)
    config = arch.hf_config(plan, seq_len)
    if tokenizer_dir is None:  # the byte tokenizer: EOS (and padding) is byte 0
      config.update(bos_token_id=None, eos_token_id=0, pad_token_id=0)
  else:
    groups = params_to_hf(remote.architecture(plan, ties), plan, dims(plan), params, progress=progress)
    config = remote.config_json(plan, config_yaml, seq_len, ties)
    remote.copy_code(out)
  if tokenizer_dir is None:  # every export loads its tokenizer: AutoTokenizer.from_pretrained(out)
    write_byte_tokenizer(out, seq_len)
  write_shards(groups, out, max_shard_bytes)
  (out / "config.json").write_text(json.dumps(config, indent=2))
  if tokenizer_dir is not None:
    local = Path(local_tokenizer_dir(str(tokenizer_dir)))  # a run's tokenizer on a bucket: its local copy
    for name in TOKENIZER_FILES:
      if (local / name).is_file():
        shutil.copy2(local / name, out / name)
  return config["architectures"][0]


def write_shards(groups: Iterable[dict[str, np.ndarray]], out: Path, max_shard_bytes: int) -> None:
  """Write tensor groups (never split across shards) as ``model.safetensors``, or as shards of at most
  ``max_shard_bytes`` (a larger group gets a shard of its own) with HF's index file when they do not fit in one."""
  shards: list[list[str]] = []
  total = 0
  pending: dict[str, np.ndarray] = {}

  def flush():
    if pending:  # safetensors.numpy writes straight from each array's buffer (the flax variant copies first)
      save_file(pending, out / f".shard-{len(shards)}.safetensors", metadata={"format": "pt"})
      shards.append(list(pending))
      pending.clear()

  for group in groups:
    size = sum(v.nbytes for v in group.values())
    if pending and sum(v.nbytes for v in pending.values()) + size > max_shard_bytes:
      flush()
    pending.update(group)
    total += size
  flush()
  if len(shards) == 1:
    (out / ".shard-0.safetensors").rename(out / SINGLE_FILE)
    return
  weight_map = {}
  for i, names in enumerate(shards):
    file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
    (out / f".shard-{i}.safetensors").rename(out / file)
    weight_map.update({name: file for name in names})
  (out / INDEX_FILE).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
def export_run(run: str | Path, out_dir: str | Path, *, progress: bool = False,
               max_shard_bytes: int = DEFAULT_SHARD_BYTES) -> tuple[str, str | None]:
  """Export a run's latest checkpoint; returns ``(architecture written, why not a transformers class or None)``.

  Raises:
    ConfigError / CheckpointError: unreadable run. FileExistsError: ``out_dir`` not empty.
  """
  loaded = load_run(run)
  cfg = loaded.cfg
  tokenizer = None if cfg.data.tokenizer == "byte" else cfg.data.tokenizer
  arch = export_params(loaded.plan, loaded.params, out_dir, config_yaml=to_yaml(cfg), seq_len=cfg.data.seq_len,
                       ties=loaded.ties, tokenizer_dir=tokenizer, progress=progress, max_shard_bytes=max_shard_bytes)
  return arch, hf_incompatibility(loaded.plan)
