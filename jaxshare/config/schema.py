"""The config's schema: one frozen dataclass per group, every field with its default, documentation
(``metadata["help"]``) and, where the values are a closed set, its allowed values (``metadata["choices"]``, from
:mod:`jaxshare.config.choices`). Loading lives in :mod:`jaxshare.config.load`, the checks in
:mod:`jaxshare.config.validate`."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from jaxshare.config.choices import (INTEGRATORS, AttentionImpl, ContextStrategy, KVPool, LisaStart, MLPWiden,
                                     RematPolicy, ScoreSharing)
from jaxshare.exit_codes import InputError

REPO_ROOT = Path(__file__).resolve().parents[2]
CONFIGS_DIR = REPO_ROOT / "configs"
DATA_DIR_ENV = "JAXSHARE_DATA_DIR"
TOKEN_CACHE_ENV = "JAXSHARE_TOKEN_CACHE"


class ConfigError(InputError, ValueError):
  """An invalid configuration: names the field, the value given and what is allowed."""


def _f(default: Any, help: str, choices: tuple[Any, ...] | None = None):
  """A dataclass field with documentation (and an allowed set, checked by :func:`validate`)."""
  meta = {"help": help}
  if choices is not None:
    meta["choices"] = choices
  if isinstance(default, (list, dict)):
    return dataclasses.field(default_factory=lambda: type(default)(default), metadata=meta)
  return dataclasses.field(default=default, metadata=meta)


@dataclasses.dataclass(frozen=True)
class Features:
  """What a flavour's blocks are made of. The model, the accounting and the schedule checks read these, never the
  flavour's name, so a new Hugging Face family is a row of :data:`FLAVORS` (plus its mapping table in
  :mod:`jaxshare.convert`).

  Attributes:
    norm: ``rmsnorm`` (scale only) or ``layernorm`` (scale and bias).
    activation: ``swiglu`` (gate, up and down projections) or ``gelu`` (up and down).
    qkv_biases: biases on the Q/K/V projections.
    dense_biases: biases on the attention output projection and the MLP's projections.
    parallel_residual: ``y = x + attn(norm1 x) + mlp(norm2 x)`` instead of the sequential residual.
  """

  norm: str
  activation: str
  qkv_biases: bool
  dense_biases: bool
  parallel_residual: bool


FLAVORS = {
  "llama": Features(norm="rmsnorm", activation="swiglu", qkv_biases=False, dense_biases=False,
                    parallel_residual=False),
  "neox": Features(norm="layernorm", activation="gelu", qkv_biases=True, dense_biases=True, parallel_residual=True),
}


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Decoder-only transformer dimensions and flavour."""

  flavor: str = _f("llama", "Block style. llama: RMSNorm, RoPE, SwiGLU MLP, no biases, sequential residual. "
                   "neox: LayerNorm, partial RoPE, GELU MLP, biases, parallel residual (GPT-NeoX/Pythia).",
                   tuple(FLAVORS))
  vocab_size: int = _f(256, "Vocabulary size (256 for the byte tokenizer; >= the HF tokenizer's size).")
  num_layers: int = _f(4, "Number of transformer layers L.")
  d_model: int = _f(128, "Residual stream width D.")
  num_heads: int = _f(4, "Query heads per layer H.")
  head_dim: int = _f(0, "Per-head width d; 0 means d_model // num_heads.")
  mlp_dim: int = _f(512, "MLP hidden width F (before any schedule.match_params widening).")
  rope_theta: float = _f(10000.0, "RoPE base frequency.")
  rotary_pct: float = _f(1.0, "Fraction of each head's dims that RoPE rotates (Pythia: 0.25).")
  rope_scaling: str = _f("none", "RoPE frequency scaling, as transformers' rope_type: none; linear (every frequency "
                         "divided by rope_scaling_factor); llama3 (Llama 3.1: low frequencies divided by the factor, "
                         "high ones kept, a blend between).", ("none", "linear", "llama3"))
  rope_scaling_factor: float = _f(1.0, "linear/llama3: the scaling factor.")
  rope_low_freq_factor: float = _f(1.0, "llama3: wavelengths above original_max_positions / this are scaled.")
  rope_high_freq_factor: float = _f(4.0, "llama3: wavelengths below original_max_positions / this are kept.")
  rope_original_max_positions: int = _f(8192, "llama3: the context length the model was pretrained with.")
  tie_embeddings: bool = _f(False, "Share the input embedding with the output projection.")
  sliding_window: int = _f(0, "Sliding-window attention (Mistral): each query attends to itself and the "
                           "sliding_window - 1 keys before it, in every layer. 0: full causal attention.")
  qkv_bias: bool = _f(False, "llama flavour: biases on the Q/K/V projections, none on the output projection or MLP "
                      "(Qwen2). The neox flavour always has Q/K/V, output and MLP biases.")
  residual: str = _f("auto", "auto: the flavour's (parallel for neox, sequential for llama). parallel: "
                     "y = x + attn(norm1 x) + mlp(norm2 x) (GPT-NeoX use_parallel_residual=true); sequential: "
                     "h = x + attn(norm1 x), y = h + mlp(norm2 h).", ("auto", "parallel", "sequential"))
  norm_eps: float = _f(1e-5, "Epsilon of RMSNorm / LayerNorm.")
  init_std: float = _f(0.02, "Standard deviation of the normal weight initialiser.")
  dtype: str = _f("float32", "Compute dtype of activations and matmuls.", ("float32", "bfloat16"))
  param_dtype: str = _f("float32", "Storage dtype of parameters and optimizer state.", ("float32", "bfloat16"))
  scan_layers: bool = _f(True, "Scan each stack of identical superblocks and each run of identical layers inside "
                         "a superblock (K/V consumers, probability reusers, LISA chains): compile time independent of "
                         "depth. Without remat (model.remat=none) a stack of superblocks of several layers is "
                         "unrolled, and under minimal one of superblocks of more than two (scanned, its backward pass slices a "
                         "whole superblock's residuals at once: more memory than dense), so its compile time grows "
                         "with depth. false unrolls the same math.")
  remat: str = _f("none", "Rematerialisation policy (MaxText's names), applied to each layer: none keeps every "
                  "result but elementwise ones (casts, norms' scaling, activations: recomputed from what is kept, as "
                  "XLA fuses them unrolled); full keeps only each superblock's input (a dense layer's) and recomputes "
                  "the rest, one layer at a time; minimal keeps the outputs of the weight matmuls (projections and "
                  "MLP); save_qkv_proj keeps the Q/K/V projections; save_dot_except_mlp those and the output "
                  "projection; save_out_proj the output projection; the named policies also keep each layer's input; "
                  "minimal_offloaded / qkv_proj_offloaded move what minimal / save_qkv_proj keep to host memory (GPU "
                  "and TPU only). What a superblock's layers share (a producer's K/V, a score source's Q, LISA's "
                  "low-rank keys) is recomputed once for all its readers and never kept per layer "
                  "(docs/scale-out.md, \"Long context\").", tuple(RematPolicy))

  @property
  def resolved_head_dim(self) -> int:
    return self.head_dim or self.d_model // self.num_heads

  @property
  def features(self) -> Features:
    """The flavour's :class:`Features` with this config's own choices applied (``qkv_bias``, ``residual``)."""
    base = FLAVORS[self.flavor]
    parallel = base.parallel_residual if self.residual == "auto" else self.residual == "parallel"
    return dataclasses.replace(base, qkv_biases=base.qkv_biases or self.qkv_bias, parallel_residual=parallel)


@dataclasses.dataclass(frozen=True)
class SAConfig:
  """Shared Attention (Beyond KV Caching, Alg. 1): reuse of post-softmax probabilities over a layer span."""

  start: int = _f(-1, "First layer of the span (0-based); -1 means num_layers // 2.")
  end: int = _f(-1, "Last layer of the span, inclusive; -1 means num_layers - 2 (the top layer is never shared).")
  semantics: str = _f("reference_code", "paper: the span's first layer computes the probabilities and the others "
                      "reuse them (|S|-1 layers lose K). reference_code (metacarbon/shareAtt): every span layer reuses "
                      "the layer before the span (|S| layers lose K: 12.5% of Llama2-7B's KV cache for the paper's span 23~30 "
                      "vs 10.9% with paper semantics, both derived by jaxshare's accounting; the paper prints neither).",
                      ("paper", "reference_code"))


@dataclasses.dataclass(frozen=True)
class UniAttnConfig:
  """UniAttn (Softmax Unification, Eq. 3-5): superblocks whose bottom layer's probabilities the others reuse."""

  block_size: int = _f(4, "Superblock size b (bottom layer produces, b-1 layers reuse).")
  start: int = _f(-1, "First layer of the unified range; -1 means num_layers // 2 (the top half, as in the paper).")
  end: int = _f(-1, "End of the range, exclusive; -1 means num_layers.")
  wc_input: str = _f("residual", "Input of the compensation x W_c: residual (the MHA input x, Eq. 5) or normed "
                     "(Norm(x)).", ("residual", "normed"))


@dataclasses.dataclass(frozen=True)
class LisaGroupConfig:
  """One group of LISA layers with its own integrator."""

  layers: list = _f([], "Layers of the group (0-based, >= 1).")
  integrator: str = _f("ffn", "The group's integrator: ffn, linear, add or none.", INTEGRATORS)


@dataclasses.dataclass(frozen=True)
class LisaConfig:
  """LISA (Cross-layer Attention Sharing, Eq. 3-4): reuse of the previous layer's pre-softmax logits + a delta."""

  layers: list = _f([], "Layers that reuse the adjacent front layer's logits (0-based, >= 1); empty means layers 3 "
                    "to num_layers - 3, i.e. 1-based 4 to L-2, the span of LISA(27) on 32 layers (4-30); the "
                    "paper's DS(10), DS(17), LISA(17) and LISA_SL(7+10) also share layer L-1 (Table 4).")
  integrator: str = _f("ffn", "How A_{n-1} and the low-rank delta combine: ffn (head aligner 2H -> hidden -> H, "
                       "ReLU; LISA), linear (2H -> H; LISA_SL), add (LISA_plus), none (direct sharing, DS). ffn and "
                       "linear start as add: A_{n-1} + A_delta (identity blocks; ffn via relu(s) - relu(-s)).",
                       INTEGRATORS)
  groups: list[LisaGroupConfig] = _f([], "Instead of layers + integrator: groups of layers, each with its own "
                                     "integrator, e.g. LISA_SL(7+10): [{layers: [4,5,16,17,18,19,20], integrator: "
                                     "linear}, {layers: [21,...,30], integrator: none}]. Needs schedule.kind=lisa.")
  rank: int = _f(4, "Per-head rank r of the low-rank Q/K that produce the delta (LLaMA: 20 of 128).")
  hidden: int = _f(0, "Hidden width of the ffn aligner, >= 2 * num_heads; 0 means 8 * num_heads (256 for 32 heads, "
                   "as in the paper).")
  rope: bool = _f(False, "Apply RoPE to the low-rank Q/K (unstated in the paper).")
  keep_qk: bool = _f(False, "Keep the full-width W_q/W_k on LISA layers (copied by train.init_from, never trained) "
                     "for NF decoding, which prefills with the original attention (LISA Sec. 5.1).")


@dataclasses.dataclass(frozen=True)
class HeadwiseConfig:
  """Head-wise weight tying (DirectShare / PostShare, Head-wise Shareable Attention Alg. 1-2)."""

  ratio: float = _f(0.0, "Sharing ratio alpha = removed parameters / all MHA parameters; N = round(alpha*4*L*H/3) "
                    "heads have W_q, W_k, W_v tied to an earlier layer's head.")
  match: str = _f("qk", "Match function (Table 12): qk (cos of W_q||W_k, the paper's), q, k, v, qkv, or "
                  "separately (q, k and v each matched and tied on their own).",
                  ("qk", "q", "k", "v", "qkv", "separately"))


@dataclasses.dataclass(frozen=True)
class ScheduleConfig:
  """Where each layer's K/V, attention scores and head weights come from (the sharing schedule)."""

  kind: str = _f("dense", "Sharing presets joined by '+', at most one of each family: K/V (dense, gqa, mqa, cla, "
                 "mlkv, explicit), scores (sa, uniattn, lisa, lisa_plus = lisa with integrator add, ds = lisa with "
                 "integrator none) and heads (headwise). E.g. 'mlkv+uniattn'.")
  kv_heads: int = _f(0, "KV heads G per producer layer (GQA within the layer; MLKV's g); 0 means num_heads.")
  kv_heads_per_layer: list = _f([], "gqa only: KV heads for each layer (length num_layers); overrides kv_heads.")
  factor: int = _f(2, "cla: sharing factor; every factor-th layer (0, f, 2f, ...) produces K/V.")
  producers: list = _f([], "cla: explicit sorted producer layer list starting at 0; overrides factor.")
  kv_layers: int = _f(0, "mlkv: number m of KV-owning layers (1 <= m <= num_layers).")
  placement: str = _f("reference_code", "mlkv owner placement: paper (MLKV Eq. 16-17, owner of layer n is "
                      "floor(n/(L/m))) or reference_code ([0]+[int((i+1)*(L/m)) ...] from pythia-mlkv).",
                      ("paper", "reference_code"))
  sources: str = _f("", "explicit: per-layer KV source, LCKV style, e.g. '0_0_2_2' (layer i reads the K/V of "
                    "layer sources[i] <= i; a layer that is its own source produces).")
  match_params: bool = _f(False, "Give the model the total parameter count of its reference by resizing every "
                          "MLP (MLKV Sec. 4's control: variants compared at equal parameters). The reference is the "
                          "source model when uptraining (train.init_from, convert uptrain: recorded in "
                          "schedule.match_reference_params), else the dense MHA model of this config.")
  match_formula: str = _f("exact", "schedule.match_params: exact (the same total parameter count as the reference, "
                          "within half an MLP neuron per layer's worth, whatever the schedule adds or drops) or "
                          "pythia_mlkv (pythia-mlkv's formula: only the K/V heads dropped relative to dense MHA, "
                          "F' = F + round(floor(P_lost / L) / D) // 2; reproduces MLKV Table 2).",
                          ("exact", "pythia_mlkv"))
  match_reference_params: int = _f(0, "schedule.match_params=exact: the total parameter count to match; 0: the dense "
                                   "MHA model of this config. Set from the source by train.init_from and convert "
                                   "uptrain, and kept in the run's config so the run rebuilds without its source.")
  sa: SAConfig = dataclasses.field(default_factory=SAConfig)
  uniattn: UniAttnConfig = dataclasses.field(default_factory=UniAttnConfig)
  lisa: LisaConfig = dataclasses.field(default_factory=LisaConfig)
  headwise: HeadwiseConfig = dataclasses.field(default_factory=HeadwiseConfig)


@dataclasses.dataclass(frozen=True)
class AttentionConfig:
  """Attention implementation switch and score-sharing memory mode."""

  impl: str = _f("auto", "auto | xla | reference | pallas | pallas_interpret | splash | splash_interpret | cudnn. xla: "
                 "XLA attention whose backward recomputes the probabilities from the saved log-sum-exp "
                 "(FlashAttention-2 style, O(T) residuals per layer); reference: plain autodiff (saves [B,H,T,T] "
                 "probabilities; the numerical source of truth); pallas: jaxshare's fused Pallas kernels (Mosaic on "
                 "TPU, Triton on GPU; flash attention, probability reuse, LISA_plus/DS features), inside shard_map "
                 "under a mesh; pallas_interpret: the same kernels in Pallas interpret mode (CPU tests; slow); "
                 "splash: jax's splash attention on TPU, cudnn: cuDNN's fused attention on GPU (bf16/fp16, head "
                 "width <= 128, packed documents: up to 16 per row on Hopper, one before it; a batch with more runs "
                 "pallas), each for every softmax role it can run, probability reuse as attention over the source "
                 "layer's q and k, jaxshare's kernels for the rest (LISA_plus's float32 features) and for decode; "
                 "splash_interpret: splash in interpret mode; auto: splash on TPU, cudnn on GPU, pallas for what "
                 "they refuse and the shapes it supports (else xla with one warning naming the reason), xla on CPU "
                 "(docs/kernels.md has the table and the measurements behind it).",
                 tuple(AttentionImpl))
  score_sharing: str = _f("recompute", "How layers that reuse attention scores get them. recompute: probability "
                          "reusers recompute exp(scale q k^T - lse) from the producer's own q, k and log-sum-exp (its "
                          "softmax to float32 rounding, in bf16 too); LISA_plus/DS chains attend over concatenated "
                          "float32 features [q/sqrt(d), q_LR/sqrt(r), ...]; nothing [B,H,T,T] is kept per reusing "
                          "layer; full LISA (ffn/linear aligners) chains hand on every layer's low-rank features and "
                          "aligner weights and recompute their logits in query chunks of 128 rows (never [B,H,T,T] for "
                          "the whole sequence). materialize: hand the probabilities / logits tensors on. Same numbers.",
                          tuple(ScoreSharing))
  chain_dtype: str = _f("float32", "What a LISA_plus/DS chain's attention reads its features [q/sqrt(d), q_LR/sqrt(r), "
                        "...] as (with score_sharing=recompute). float32: its logits equal the materialised sum of "
                        "logits to float32 rounding; on GPUs the chain runs jaxshare's Triton kernels (cuDNN takes "
                        "bf16/fp16 only; splash on TPUs takes either). compute: model.dtype, rounded as a bf16 layer's "
                        "own q and k are; on Hopper GPUs cuDNN then runs the chain, its Q/K wider than V (jax's MLA "
                        "path; docs/kernels.md).", ("float32", "compute"))
  context_strategy: str = _f("all_gather", "How attention reads the keys of a sequence split over mesh.context "
                             "(MaxText's context_parallel_strategy; docs/scale-out.md, \"Long context\"). all_gather: "
                             "a producer's K/V (a LISA layer's low-rank keys) are gathered once and every layer that "
                             "reads them uses the gathered copy, so K/V consumers and probability reusers move nothing "
                             "of their own; a layer's whole K/V then lives on every device of the axis. ring: the K/V "
                             "blocks travel round the axis (ppermute) and each device holds one block of T/context "
                             "tokens at a time, at the price of every reader rotating them itself.",
                             tuple(ContextStrategy))


@dataclasses.dataclass(frozen=True)
class DataConfig:
  """Input pipeline (grain): source, tokenizer, packing, splits."""

  source: str = _f("text", "text: a local UTF-8 text file; jsonl: one JSON object per line with a text field; "
                   "tfds: a TFDS dataset read through tfds.data_source (no TensorFlow); prepared: a directory written "
                   "by python -m jaxshare.data prepare (local or gs://; its manifest sets the splits).",
                   ("text", "jsonl", "tfds", "prepared"))
  path: str = _f("tinyshakespeare.txt", "text/jsonl file or prepared directory (local or gs://). A relative path is "
                 "looked for in the working directory first (what you typed, e.g. the --out of a prepare run from "
                 "there), then in the data directory (data_dir), where corpus names such as tinyshakespeare.txt are "
                 "found; a missing path's error names both places.")
  data_dir: str = _f("", f"The data directory: where a relative data.path (or mixture path) not found in the working "
                     f"directory is looked for. Empty: ${DATA_DIR_ENV} if set, else ../shared/data relative to the "
                     "repository root.")
  text_field: str = _f("text", "jsonl/tfds: name of the text field of each record.")
  tfds_name: str = _f("", "tfds: dataset name, e.g. tiny_shakespeare.")
  tfds_split: str = _f("train", "tfds: split to read; the validation split is carved from it.")
  tfds_data_dir: str = _f("", "tfds: data dir holding prepared datasets (empty: TFDS default).")
  document_separator: str = _f("", "text: split the file into documents at this string (empty: one document).")
  tokenizer: str = _f("byte", "byte (UTF-8 bytes, ids 0-255, EOS = 0) or a local Hugging Face tokenizer dir.")
  seq_len: int = _f(128, "Tokens per training sequence T.")
  val_fraction: float = _f(0.1, "Held-out validation share: the corpus's last documents, cut at the document "
                           "boundary nearest to it (inside the document for a one-document corpus). Not read for "
                           "source=prepared, whose manifest sets the splits.")
  shuffle_seed: int = _f(0, "Seed of the deterministic per-epoch shuffle.")
  mixture: list = _f([], "source=prepared: train on several prepared directories mixed by weight, each entry "
                     "{path: DIR, weight: W[, name: NAME]} (e.g. [{path: gs://b/web, weight: 0.7}, {path: gs://b/code, "
                     "weight: 0.3}]); batches follow the weights deterministically (grain's mix) and the log counts "
                     "the tokens seen per component. data.path is then not read. Empty: data.path alone.")
  token_cache: str = _f("", "Directory where text/jsonl/tfds sources are prepared on first use (token shards as "
                        "python -m jaxshare.data prepare writes them, memory-mapped by every process; prepared once, "
                        f"under a file lock). Empty: ${TOKEN_CACHE_ENV} if set, else ~/.cache/jaxshare/tokens. off: "
                        "prepare into a temporary directory each run.")


@dataclasses.dataclass(frozen=True)
class MeshConfig:
  """Device mesh: sizes inside a slice (data x fsdp x context x tensor = its devices, one may be -1) times dcn_* sizes
  across slices."""

  # MaxText's ici/dcn split: a slice is a TPU slice over ICI, or a process of a GPU/CPU cluster; slices talk over the
  # data-centre network, where only data parallelism is cheap.

  data: int = _f(1, "Data-parallel axis size inside a slice (batch sharded, parameters replicated).")
  fsdp: int = _f(1, "Fully-sharded data-parallel axis size inside a slice (batch and parameters sharded).")
  context: int = _f(1, "Context-parallel axis size inside a slice (MaxText's ici_context_parallelism): every "
                    "sequence's tokens split over it in a load-balanced causal layout (chunks i and 2c-1-i on device "
                    "i), K/V all-gathered over it once per producer layer, parameters FSDP-sharded over it too. "
                    "data.seq_len must be a multiple of 2 x its size x dcn_context.")
  tensor: int = _f(1, "Tensor-parallel axis size inside a slice (heads and MLP sharded).")
  dcn_data: int = _f(1, "Data-parallel size across slices (multi-slice TPU: data parallel over DCN, fsdp/tensor "
                     "inside each slice). 1: one slice.")
  dcn_fsdp: int = _f(1, "FSDP size across slices (rarely worth the DCN traffic; MaxText's dcn_fsdp_parallelism).")
  dcn_context: int = _f(1, "Context-parallel size across slices (MaxText's dcn_context_parallelism; each layer's K/V "
                        "gather then crosses the DCN).")
  dcn_tensor: int = _f(1, "Tensor-parallel size across slices (almost never worth it).")

  @property
  def num_slices(self) -> int:
    return self.dcn_data * self.dcn_fsdp * self.dcn_context * self.dcn_tensor

  @property
  def context_size(self) -> int:
    """Devices one sequence is split over (``context x dcn_context``; -1 counts as unknown: 0)."""
    return max(self.context, 0) * self.dcn_context


@dataclasses.dataclass(frozen=True)
class DistributedConfig:
  """Multi-host runs (jax.distributed.initialize): one process per TPU VM worker or GPU, all running one command."""

  initialize: str = _f("auto", "auto: initialise when a cluster is detected (a TPU pod slice with several workers, a "
                       "Slurm job step with several tasks, or coordinator_address set) and run alone otherwise; on: "
                       "always (JAX's cluster auto-detection, or the fields below); off: never (one process).",
                       ("auto", "on", "off"))
  coordinator_address: str = _f("", "host:port of process 0's coordinator, for clusters JAX does not detect itself "
                                "(e.g. localhost:1234 for processes on one machine). Empty: auto-detected.")
  num_processes: int = _f(0, "Number of processes with coordinator_address (0: auto-detected).")
  process_id: int = _f(-1, "This process's index in [0, num_processes) with coordinator_address (-1: auto-detected).")
  local_device_ids: list = _f([], "Devices this process drives (e.g. [0] for one GPU per process); empty: all "
                              "visible ones.")
  timeout_s: int = _f(300, "Seconds to wait for every process to join the coordinator.")


@dataclasses.dataclass(frozen=True)
class TrainConfig:
  """Optimisation, logging, validation and checkpoint cadence."""

  run_dir: str = _f("runs/default", "Run directory: config.yaml, metrics.jsonl, TensorBoard events, checkpoints. "
                    "Re-running with the same directory resumes from its latest checkpoint.")
  steps: int = _f(2000, "Optimizer steps.")
  batch_size: int = _f(32, "Global batch size in sequences per optimizer step.")
  grad_accum_steps: int = _f(1, "Micro-batches per step (batch_size must divide by it).")
  lr: float = _f(3e-3, "Peak learning rate of AdamW.")
  warmup_steps: int = _f(100, "Linear warm-up steps.")
  min_lr_ratio: float = _f(0.1, "Final learning rate of the cosine decay as a fraction of lr.")
  weight_decay: float = _f(0.1, "AdamW decoupled weight decay (not applied to norms, biases, embeddings).")
  b1: float = _f(0.9, "AdamW beta1.")
  b2: float = _f(0.95, "AdamW beta2.")
  eps: float = _f(1e-8, "AdamW epsilon.")
  clip_norm: float = _f(1.0, "Global gradient-norm clip; 0 disables.")
  num_vocab_tiling: int = _f(1, "Compute the language-modelling loss over this many tiles of the vocabulary (MaxText's "
                             "name): only [B, T, V / tiles] logits exist at a time, recomputed in the backward pass, "
                             "where whole logits and their gradient take 31 GiB per 128k-token sequence at V = 32000 "
                             "in float32. Must divide model.vocab_size; 1: whole logits.")
  seed: int = _f(0, "Parameter initialisation seed.")
  nan_policy: str = _f("stop", "A step whose loss or gradient norm is not finite never updates the state. stop: the run "
                       "stops at the next log line or checkpoint with a diagnostic (exit code 3), writing no checkpoint "
                       "after the last good one; skip: such steps are skipped, counted and logged, and training goes "
                       "on.", ("stop", "skip"))
  log_every: int = _f(25, "Steps between log lines / metrics records.")
  eval_every: int = _f(250, "Steps between validation passes; 0 disables periodic validation.")
  eval_batches: int = _f(16, "Validation batches per pass (0: the whole validation split).")
  checkpoint_every: int = _f(500, "Steps between checkpoints (one is always written at the end).")
  keep_checkpoints: int = _f(2, "Checkpoints kept on disk.")
  storage_patience_s: float = _f(300.0, "A run directory on a bucket (gs://): how long, in seconds, writing its "
                                 "files (metrics, TensorBoard events) is retried with exponential backoff while the "
                                 "bucket is unreachable or failing, before the run stops with one line (exit code 4; "
                                 "run it again to resume from its last committed checkpoint). A checkpoint write "
                                 "that fails after TensorStore's own retries stops the run the same way.")
  peak_tflops: float = _f(0.0, "Per-device peak TFLOP/s that MFU is reported against; 0: the vendor's dense bf16 "
                          "peak of a known TPU/GPU, or on CPU the host's matmul roofline measured at start.")
  progress_bar: bool = _f(True, "Show a tqdm progress bar (log lines are printed either way).")
  init_from: str = _f("", "Uptraining: initialise from this run directory or checkpoint (e.g. a dense model): "
                      "every parameter with the same layer, name and shape is copied, each K/V producer's "
                      "projections are pooled from the source (train.init_kv_pool), new modules keep their "
                      "initialisation; the log lists which rule built each. The run takes the source's model, "
                      "schedule and data.tokenizer unless the experiment file or an override sets them (a run made by "
                      "convert uptrain trains as the schedule it was converted into); a model whose weight shapes "
                      "or tokenizer differ from the source's is refused. Empty: train from scratch.")
  init_lisa: str = _f("ds", "Uptraining into LISA: how a LISA layer's low-rank Q/K start. ds: k_lr = 0 (A_delta = "
                      "0; with the aligners' initial sum the layer starts as DS, exact reuse of the previous layer's "
                      "logits); fit: the rank-r truncated SVD of the difference between the source layer's own W_q "
                      "W_k^T and its score source's, per K/V group, so A_{n-1} + A_delta approximates the layer's own "
                      "logits (RoPE ignored); calibrated (python -m jaxshare.convert uptrain only: it reads calibration "
                      "batches): fit, then Adam on the factors so the logits each converted layer uses match the "
                      "source layer's own over the batches' causal positions (RoPE and the converted inputs "
                      "included). All are jaxshare's: LISA prescribes no conversion start.",
                      tuple(LisaStart))
  init_kv_pool: str = _f("auto", "Uptraining into K/V sharing: how a producer's K/V are built from the source layers "
                         "that read them (heads always mean-pooled into the target's groups, GQA Sec. 2.1). mean: "
                         "uniform mean over the layers (MLKV); running: pythia-mlkv's running pairwise mean; "
                         "producer: the producer layer's own (this project's rule: CLA trains from scratch); auto: producer for cla, mean otherwise.",
                         tuple(KVPool))
  init_mlp_widen: str = _f("zero", "Uptraining with schedule.match_params: how a widened MLP's new hidden units start. "
                           "zero: fresh input weights, zero output rows (the source's function is kept); duplicate: "
                           "copies of the first units, as pythia-mlkv's conversion (the function changes).",
                           tuple(MLPWiden))
  trainable: str = _f("all", "Parameters the optimizer updates: all, or sharing (only the modules the sharing "
                      "methods add: LISA's low-rank Q/K and aligner, UniAttn's W_c); the rest are frozen with "
                      "optax masks.", ("all", "sharing"))
  kd_beta: float = _f(0.0, "LISA distillation (Eq. 5-7): loss = kd_beta * Huber(student logits, teacher logits on "
                      "the LISA layers) + (1 - kd_beta) * LM loss; the teacher is train.kd_teacher, frozen. 0: off; "
                      "the paper uses 0.25.")
  kd_teacher: str = _f("", "Distillation's teacher (train.kd_beta > 0): a run directory or checkpoint, used whatever its "
                       "schedule. Empty: the dense model train.init_from was converted from (convert uptrain records "
                       "it here in the converted run's config), else train.init_from itself; a teacher found so that "
                       "is not dense is refused (name it here to distil from it).")
  kd_delta: float = _f(1.0, "Huber delta of the distillation loss.")
  postshare_gamma: float = _f(0.0, "PostShare (Eq. in Sec. 4.3): add gamma * L_w, L_w = mean over the matched head "
                              "pairs of sum_{q,k,v} ||W_i - W_j||_F, pairs selected by DirectShare at "
                              "train.postshare_ratio on the initial weights (dense MHA models). 0: off; paper 0.5.")
  postshare_ratio: float = _f(0.3, "PostShare: sharing ratio alpha of the pair selection (match: "
                              "schedule.headwise.match).")
  recipe: str = _f("standard", "standard, or uniattn_two_stage: stage 1 trains only W_c until the EMA of the "
                   "training loss stops improving (or train.stage1_max_steps), stage 2 fine-tunes everything with a "
                   "fresh optimizer and its own warm-up + cosine schedule over the remaining steps (or "
                   "train.stage2_steps).",
                   ("standard", "uniattn_two_stage"))
  stage1_max_steps: int = _f(200, "uniattn_two_stage: most steps of stage 1.")
  stage1_ema: float = _f(0.9, "uniattn_two_stage: decay of the training-loss EMA watched for early stopping.")
  stage1_patience: int = _f(20, "uniattn_two_stage: stop stage 1 after this many steps without a new EMA minimum.")
  stage2_steps: int = _f(0, "uniattn_two_stage: steps of stage 2, counted from the step stage 1 ended, as the paper "
                         "gives fine-tuning its own budget after stage 1 (UniAttn Alg. 1, App. D): the run ends at "
                         "stage 1's length + stage2_steps, and train.steps is only an upper bound (at least "
                         "stage1_max_steps + stage2_steps). 0: stage 2 takes what remains of train.steps.")


@dataclasses.dataclass(frozen=True)
class Config:
  """The whole experiment."""

  model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
  schedule: ScheduleConfig = dataclasses.field(default_factory=ScheduleConfig)
  attention: AttentionConfig = dataclasses.field(default_factory=AttentionConfig)
  data: DataConfig = dataclasses.field(default_factory=DataConfig)
  mesh: MeshConfig = dataclasses.field(default_factory=MeshConfig)
  distributed: DistributedConfig = dataclasses.field(default_factory=DistributedConfig)
  train: TrainConfig = dataclasses.field(default_factory=TrainConfig)


def mixture_name(entry: dict) -> str:
  """A mixture component's name: its ``name``, else its directory's last part."""
  return str(entry.get("name") or str(entry["path"]).rstrip("/").rpartition("/")[2])
