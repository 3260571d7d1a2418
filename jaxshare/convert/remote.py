"""Every sharing schedule as a transformers remote-code directory (``JaxshareForCausalLM``).

A model no transformers class holds exactly (K/V sharing across layers, score reuse, W_c, head-wise ties, per-layer
K/V head counts) is exported as ``config.json`` (``model_type`` ``jaxshare``, an ``auto_map`` naming the two code
files, every layer's plan as plain lists, and the whole jaxshare config for a bit-exact import), the code files
``configuration_jaxshare.py`` / ``modeling_jaxshare.py`` (:mod:`jaxshare.serve.remote_code`, copied as they are),
``model.safetensors`` with HF-style tensor names (the table below, which import reads too) and the tokenizer files.
``AutoModelForCausalLM.from_pretrained(dir, trust_remote_code=True)`` loads it offline.
"""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

from jaxshare.config import Config, apply_overrides, config_from_yaml_text
from jaxshare.convert import hf_config as C
from jaxshare.convert.mapping import Architecture, Dims, Rule, UnsupportedModelError, linear, same
from jaxshare.model import params as P
from jaxshare.model.ties import MATRICES, HeadTies
from jaxshare.plan import ModelPlan
from jaxshare.schedule import LayerRole, Schedule
from jaxshare.serve import REMOTE_CODE_DIR

ARCHITECTURE = "JaxshareForCausalLM"
MODEL_TYPE = "jaxshare"
FORMAT_VERSION = 2  # 1: the native layout (jaxshare parameter paths), written before remote code
CODE_FILES = ("configuration_jaxshare.py", "modeling_jaxshare.py")
AUTO_MAP = {"AutoConfig": "configuration_jaxshare.JaxshareConfig",
            "AutoModelForCausalLM": "modeling_jaxshare.JaxshareForCausalLM"}
_L = "model.layers.{i}."


def layer_plans(schedule: Schedule) -> list[dict]:
  """Every layer's role with absolute layer indices, as ``configuration_jaxshare.JaxshareConfig.layer_plans``."""
  plans = []
  for layer in range(len(schedule.layers)):
    role, start = _role(schedule, layer)
    plans.append({
      "kv_source": layer if role.kv_from is None else start + role.kv_from, "num_kv_heads": role.num_kv_heads,
      "score_reuse": role.score_reuse,
      "score_source": {"probs": None if role.score_from is None else start + role.score_from,
                       "logits": layer - 1}.get(role.score_reuse), "feeds": role.feeds,
      "integrator": role.integrator, "lisa_rank": role.lisa_rank, "lisa_hidden": role.lisa_hidden,
      "lisa_rope": role.lisa_rope, "keep_qk": role.keep_qk, "compensation": role.compensation,
      "wc_normed": role.wc_normed, "tied_qkv": role.tied_qkv})
  return plans


def config_json(plan: ModelPlan, config_yaml: str, seq_len: int, ties: HeadTies | None) -> dict:
  """``config.json`` of a remote-code directory of the model of ``plan`` trained on ``seq_len`` tokens: what
  ``JaxshareConfig`` reads, plus the run's jaxshare config ``config_yaml`` (as :func:`~jaxshare.config.to_yaml`
  writes it) and head-wise ``ties``."""
  m, f = plan.model, plan.model.features
  rope = C.rope_parameters(m)
  return {
    "architectures": [ARCHITECTURE], "model_type": MODEL_TYPE, "auto_map": AUTO_MAP,
    "jaxshare_format_version": FORMAT_VERSION, "vocab_size": m.vocab_size, "hidden_size": m.d_model,
    "intermediate_size": plan.mlp_dim, "num_hidden_layers": m.num_layers,
    "num_attention_heads": m.num_heads, "head_dim": m.resolved_head_dim,
    "hidden_act": "silu" if f.activation == "swiglu" else "gelu", "norm_type": f.norm, "norm_eps": m.norm_eps,
    "parallel_residual": f.parallel_residual, "attention_bias": f.qkv_biases, "dense_bias": f.dense_biases,
    "rope_theta": m.rope_theta, "rotary_dim": int(m.resolved_head_dim * m.rotary_pct),
    "rotary_scaling": None if rope["rope_type"] == "default" else rope, "sliding_window": m.sliding_window,
    "max_position_embeddings": C.max_positions(seq_len), "tie_word_embeddings": m.tie_embeddings,
    "layer_plans": layer_plans(plan.schedule),
    "head_index": {k: [list(r) for r in ties.index[k]] for k in MATRICES} if ties else None,
    "head_rows": {k: len(ties.rows[k]) for k in MATRICES} if ties else None,
    "dtype": m.dtype, "jaxshare_config": config_yaml,
    **({"jaxshare_head_ties": ties.to_json()} if ties else {})}


def copy_code(out: Path) -> None:
  """Write the remote-code files into ``out``."""
  for name in CODE_FILES:
    shutil.copyfile(REMOTE_CODE_DIR / name, out / name)


def _bias(hf: str, path: str, heads, width) -> Rule:
  """A ``[heads·width]`` projection bias <-> jaxshare's ``[heads, width]`` (``heads``, ``width``: of the layer's
  dimensions)."""
  return Rule((hf,), (path,), lambda n: [(heads(n) * width(n),)],
              lambda a, n: [a[0].reshape(heads(n), width(n))], lambda a, n: [a[0].reshape(-1)])


def _norm(hf: str, path: str) -> list[Rule]:
  return [same(hf + ".weight", path + "/scale", lambda n: (n.D,)), same(hf + ".bias", path + "/bias", lambda n: (n.D,))]


def architecture(plan: ModelPlan, ties: HeadTies | None) -> Architecture:
  """The remote-code table of the model of ``plan``: every layer's dimensions from its role and the MLP width the
  model is built with (widened when the schedule matches parameters); ``ties``: head-wise sharing's (its stored rows
  are global tensors), None without."""
  rows = {m: len(r) for m, r in ties.rows.items()} if ties is not None else None
  mlp = plan.mlp_dim

  def layer_dims(dims: Dims, schedule: Schedule, layer: int) -> Dims:
    role, _ = _role(schedule, layer)
    return dataclasses.replace(dims, G=role.num_kv_heads, r=role.lisa_rank, A=role.lisa_hidden, F=mlp)

  def global_rules(model) -> list[Rule]:
    rules = [same("model.embed_tokens.weight", "embedding", lambda n: (n.V, n.D)), *_norm("model.norm", "final_norm"),
             linear("lm_head.weight", "lm_head/kernel", lambda n: (n.D,), lambda n: (n.V,))]
    for m in MATRICES if rows else ():
      rules.append(same(f"model.head_table.{m}", f"head_table/{m}", lambda n, m=m: (rows[m], n.D, n.d)))
    return rules

  def layer_rules(model) -> list[Rule]:
    a = _L + "self_attn."
    H, G, d, r = (lambda n: n.H), (lambda n: n.G), (lambda n: n.d), (lambda n: n.r)
    return [
      *_norm(_L + "input_layernorm", "norm1"), *_norm(_L + "post_attention_layernorm", "norm2"),
      *(linear(a + f"{m}_proj.weight", f"attn/{m}_proj/kernel", lambda n: (n.D,), lambda n, h=h: (h(n), n.d))
        for m, h in (("q", H), ("k", G), ("v", G))),
      *(_bias(a + f"{m}_proj.bias", f"attn/{m}_proj/bias", h, d) for m, h in (("q", H), ("k", G), ("v", G))),
      linear(a + "o_proj.weight", "attn/o_proj/kernel", lambda n: (n.H, n.d), lambda n: (n.D,)),
      same(a + "o_proj.bias", "attn/o_proj/bias", lambda n: (n.D,)),
      linear(a + "q_lr.weight", "attn/q_lr/kernel", lambda n: (n.D,), lambda n: (n.H, n.r)),
      linear(a + "k_lr.weight", "attn/k_lr/kernel", lambda n: (n.D,), lambda n: (n.G, n.r)),
      _bias(a + "q_lr.bias", "attn/q_lr/bias", H, r), _bias(a + "k_lr.bias", "attn/k_lr/bias", G, r),
      same(a + "align_in", "attn/align_in", lambda n: (2 * n.H, n.A)),
      same(a + "align_out", "attn/align_out", lambda n: (n.A, n.H)),
      same(a + "align", "attn/align", lambda n: (2 * n.H, n.H)),
      linear(_L + "compensation.weight", "compensation/kernel", lambda n: (n.D,), lambda n: (n.D,)),
      linear(_L + "mlp.gate_proj.weight", "mlp/gate/kernel", lambda n: (n.D,), lambda n: (n.F,)),
      linear(_L + "mlp.up_proj.weight", "mlp/up/kernel", lambda n: (n.D,), lambda n: (n.F,)),
      same(_L + "mlp.up_proj.bias", "mlp/up/bias", lambda n: (n.F,)),
      linear(_L + "mlp.down_proj.weight", "mlp/down/kernel", lambda n: (n.F,), lambda n: (n.D,)),
      same(_L + "mlp.down_proj.bias", "mlp/down/bias", lambda n: (n.D,)),
    ]

  return Architecture((ARCHITECTURE, MODEL_TYPE), lambda config: [], lambda plan, seq_len: {}, global_rules,
                      layer_rules, layer_dims=layer_dims, rules_by_presence=True)


def _role(schedule: Schedule, layer: int) -> tuple[LayerRole, int]:
  """A layer's role and the first layer of its superblock (the role's positions count from there)."""
  s_idx, c, r_idx, _ = P.layer_location(schedule, layer)
  stack = schedule.stacks[s_idx]
  return stack.runs[r_idx].role, stack.start + c * stack.superblock_size


def read_config(config: dict, overrides) -> Config:
  """The jaxshare config of a remote-code ``config.json`` with ``overrides`` applied (``train.*``, ``data.*``,
  ``attention.*``: the model and its schedule are the directory's). Its compiled plan is checked against the
  directory's other fields by :func:`read_ties`.

  Raises:
    UnsupportedModelError: another format version (a native directory of an older jaxshare), no jaxshare config,
      or overrides that change the model or the schedule.
  """
  version = config.get("jaxshare_format_version")
  if version != FORMAT_VERSION:
    raise UnsupportedModelError(
      f"config.json jaxshare_format_version={version!r}: this jaxshare reads {FORMAT_VERSION} (remote code); a "
      "directory without it is an older jaxshare's native export: export the run again with this jaxshare")
  text = config.get("jaxshare_config")
  if not isinstance(text, str):
    raise UnsupportedModelError(f"config.json says {ARCHITECTURE} but has no 'jaxshare_config' text")
  exported = config_from_yaml_text(text)
  cfg = apply_overrides(exported, overrides)
  moved = [group for group in ("model", "schedule") if getattr(cfg, group) != getattr(exported, group)]
  if moved:
    raise UnsupportedModelError(f"overrides {list(overrides)} change the {' and '.join(moved)} of a remote-code "
                                "directory, whose parameters are those of its own: import it as it is, then "
                                "`python -m jaxshare.convert uptrain RUN OUT schedule.*=...`")
  return cfg


def read_ties(config: dict, plan: ModelPlan) -> HeadTies | None:
  """The head-wise ties a remote-code ``config.json`` carries for the model of ``plan`` (None: it ties no heads),
  once its fields are checked against those its jaxshare config gives.

  Raises:
    UnsupportedModelError: ties missing, malformed or not of the model's shape, or a ``config.json`` whose model
      fields or layer plans disagree with its jaxshare config (edited by hand).
  """
  ties = _stored_ties(config, plan)
  text = config["jaxshare_config"]
  expected = config_json(plan, text, config_from_yaml_text(text).data.seq_len, ties)
  changed = [k for k, v in expected.items() if k not in ("jaxshare_config", "dtype") and config.get(k) != v]
  if changed:
    k = changed[0]
    raise UnsupportedModelError(f"config.json {k}={config.get(k)!r} disagrees with its jaxshare_config, which gives "
                                f"{expected[k]!r} (edited by hand?): export the run again")
  return ties


def _stored_ties(config: dict, plan: ModelPlan) -> HeadTies | None:
  schedule = plan.schedule
  if not schedule.tied_heads:
    return None
  text = config.get("jaxshare_head_ties")
  if not isinstance(text, str):
    raise UnsupportedModelError(f"config.json ties {schedule.tied_heads} heads but has no 'jaxshare_head_ties': "
                                "export the run again")
  try:
    ties = HeadTies.from_json(text, "'jaxshare_head_ties' of config.json")
    ties.check(len(schedule.layers), plan.model.num_heads, schedule.tied_heads,
               "'jaxshare_head_ties' of config.json")
  except ValueError as e:
    raise UnsupportedModelError(f"{e} (edited by hand?): export the run again") from None
  return ties
