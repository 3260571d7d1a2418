"""Property-based tests (hypothesis) of configuration and schedule validation.

Configs are built as users build them: dotted ``key=value`` override strings parsed by :func:`load_config` (YAML
reading of the values included). Every drawn combination is judged twice: by validation (``load_config``, then
``compile_schedule``, as every entry point runs them) and by an oracle written from the documented rule of each
field (tests/support/schedule_oracle.py), independently of the code under test. The properties:

* a combination the oracle calls invalid is rejected with a :class:`ConfigError` (a ``ScheduleError`` is one) whose
  message names an offending field by its dotted name (``schedule.kv_heads``); nothing else is ever raised;
* a combination the oracle calls valid is accepted, compiles to the per-layer K/V sources, K/V head counts, score
  reuse and tied-head count the oracle predicts, and builds: ``setup_training`` on a one-device mesh and an abstract
  forward pass with its loss (``jax.eval_shape`` on a ``[batch, seq]`` int32 input) give ``[batch, seq, vocab]``
  float32 logits and a scalar loss;
* any value at all, in any field (or under a malformed key), is either accepted and builds or rejected with a
  ConfigError that names the key.

Each property test ends by reporting how many invalid inputs it tried (every one rejected, naming the field) and how
many valid ones it built: ``pytest -rA tests/unit/schedule/test_properties.py`` shows the lines,
``--hypothesis-show-statistics`` the events. Examples are derandomized, so every run (and CI) draws the same ones.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import pytest
from flax import nnx
from hypothesis import HealthCheck, event, example, given, note, settings, strategies as st

from conftest import TINY
from jaxshare.config import Config, ConfigError, MeshConfig, load_config
from jaxshare.data.batch import Batch
from jaxshare.parallel import make_mesh
from jaxshare.schedule import compile_schedule
from jaxshare.train.state import setup_training
from jaxshare.model.loss import masked_cross_entropy
from support.schedule_oracle import (
  FIELDS, FLOAT_FIELDS, GROUPS, INF, INT_LIST_FIELDS, NAN, config_leaves, finite, flat_config, is_int, model_specs,
  named_fields, oracle, overrides, same, schedule_specs)

BATCH = 2
PROPERTY = settings(max_examples=150, deadline=None, derandomize=True, database=None, print_blob=False,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])


# ---------------------------------------------------------------------------------------------------------------------
# Overrides as a user types them


# ---------------------------------------------------------------------------------------------------------------------
# The oracle: the documented rule of every field, applied to the effective values (BASE updated with the spec)


# ---------------------------------------------------------------------------------------------------------------------
# Judging one drawn config


@pytest.fixture(scope="module")
def mesh():
  return make_mesh(MeshConfig(), jax.devices()[:1])


def build(cfg: Config, mesh) -> None:
  """setup_training on the one-device mesh, then an abstract forward pass and loss of the model."""
  setup = setup_training(cfg, mesh)
  batch = Batch.spec(BATCH, cfg.data.seq_len)

  def forward(params, batch):
    logits = nnx.merge(setup.graphdef, params)(batch.inputs, batch.positions, batch.segment_ids)
    return logits, masked_cross_entropy(logits, batch)

  with jax.set_mesh(mesh):
    logits, (loss, count) = jax.eval_shape(forward, setup.abstract_params, batch)
  assert (logits.shape, logits.dtype) == ((BATCH, cfg.data.seq_len, cfg.model.vocab_size), jnp.float32)
  assert loss.shape == count.shape == ()
  assert len(setup.schedule.layers) == cfg.model.num_layers and setup.num_params > 0


def judge(spec: dict[str, Any], mesh, counts: dict[str, int], spelling: int = 0) -> None:
  """Validation against the oracle: rejected naming an offending field, or accepted as predicted and built."""
  verdict = oracle(spec)
  note(f"overrides: {overrides(spec, spelling)[len(TINY):]}\noracle: {verdict.violations}")
  try:
    cfg = load_config(None, overrides(spec, spelling))
    schedule = compile_schedule(cfg.model, cfg.schedule)
  except ConfigError as e:
    named = named_fields(str(e))
    assert verdict.violations, f"rejected a combination the documented rules allow: {e}"
    blamed = frozenset().union(*verdict.violations)
    assert named & blamed, f"the error names {sorted(named) or 'no field'}, not one of {sorted(blamed)}: {e}"
    counts["invalid inputs tried and rejected"] += 1
    event(f"rejected: {sorted(named & blamed)[0]}")
    return
  assert not verdict.violations, f"accepted although {[sorted(b) for b in verdict.violations]} are invalid"
  for key, value in spec.items():  # the YAML text was read as intended
    assert same(flat_config(cfg)[key], value), (key, flat_config(cfg)[key], value)
  assert [p.kv_source for p in schedule.layers] == verdict.sources
  assert [p.num_kv_heads for p in schedule.layers] == list(verdict.heads)
  assert {p.index: (p.score_reuse, p.score_source, p.integrator) for p in schedule.layers
          if p.score_reuse} == verdict.reuse
  assert schedule.tied_heads == verdict.tied
  build(cfg, mesh)
  counts["valid inputs built"] += 1
  event(f"built: {schedule.kind}")


def report(request, name: str, counts: dict[str, int]) -> None:
  line = f"{name}: " + ", ".join(f"{n} {k}" for k, n in counts.items())
  print(line)
  request.node.user_properties.append((name, dict(counts)))
  assert all(counts.values()), f"a property test drew no examples of one side: {line}"


# ---------------------------------------------------------------------------------------------------------------------
# Strategies


# ---------------------------------------------------------------------------------------------------------------------
# The properties


def test_model_and_optimizer_fields_are_rejected_by_name_or_build(mesh, request):
  """Model dimensions (non-divisible, zero, negative) and model/optimizer floats (nan, inf, negative, out of range),
  as YAML text: every combination the documented rules forbid is rejected naming an offending field; every other
  one builds."""
  counts = {"invalid inputs tried and rejected": 0, "valid inputs built": 0}

  @PROPERTY
  @given(model_specs(), st.integers(0, 2))
  # regressions, each failing before its fix in config.validate: non-finite floats of fields the run may ignore, and
  # a negative peak, were accepted
  @example({"model.rope_low_freq_factor": NAN}, 0)
  @example({"model.rope_scaling": "none", "model.rope_high_freq_factor": INF}, 1)
  @example({"train.peak_tflops": -1.0}, 0)
  def check(spec, spelling):
    judge(spec, mesh, counts, spelling)

  check()
  report(request, "model and optimizer fields", counts)


def test_schedules_are_rejected_by_name_or_compile_as_documented_and_build(mesh, request):
  """Every preset and '+' combination with the knobs its presets read, in and out of range, plus malformed
  expressions and knobs set under presets that ignore them: rejected naming an offending field, or compiled to the
  documented per-layer plan and built."""
  counts = {"invalid inputs tried and rejected": 0, "valid inputs built": 0}

  @PROPERTY
  @given(schedule_specs())
  # regressions, each failing before its fix in jaxshare.schedule: a producer list with a string or a nested list
  # raised TypeError;
  # a float or bool in it was accepted (layer 1.5 silently dropped, True taken as layer 1)
  @example({"schedule.kind": "cla", "schedule.producers": [0, "a"]})
  @example({"schedule.kind": "cla", "schedule.producers": [0, [1]]})
  @example({"schedule.kind": "cla", "schedule.producers": [0, 1.5, 3]})
  @example({"schedule.kind": "cla", "schedule.producers": [0, True]})
  # ... bools taken for head counts and layers: G=True K/V heads, LISA on layer True
  @example({"schedule.kind": "gqa", "schedule.kv_heads_per_layer": [True] * 4})
  @example({"schedule.kind": "lisa", "schedule.lisa.layers": [True]})
  # ... a LISA layer listed twice blamed schedule.lisa.groups (not set); an invalid layer named no dotted field
  @example({"schedule.kind": "lisa", "schedule.lisa.layers": [2, 2]})
  @example({"schedule.kind": "lisa", "schedule.lisa.layers": [2, "x"]})
  @example({"model.num_layers": 1, "schedule.kind": "lisa", "schedule.lisa.layers": [1]})
  # ... head-wise sharing was accepted with K/V consumers (CLA, MLKV with m < L) and with Q/K/V biases (dropped)
  @example({"schedule.kind": "cla+headwise", "schedule.headwise.ratio": 0.3})
  @example({"schedule.kind": "mlkv+headwise", "schedule.kv_layers": 2, "schedule.headwise.ratio": 0.3})
  @example({"schedule.kind": "headwise", "schedule.headwise.ratio": 0.3, "model.qkv_bias": True})
  def check(spec):
    judge(spec, mesh, counts)

  check()
  report(request, "schedules", counts)


ODD_KEYS = ["", "model.", ".model", "model..d_model", "model.nope", "nope", "model.d_model.x", "schedule.producers.0",
            "schedule.kv_heads_per_layer[0]", "schedule.lisa.groups.0.layers"]
RAW_VALUES = ["abc", "", "null", "~", "[1", "{a: 1}", "[1, 2]", "[]", "{}", "1.5", "-3", "0", "1e400", "nan", ".inf",
              "-inf", "true", "0x10", "'5'", "2", "-1", "7", "100000", "[0, 1, x]", "[[0]]", "[true]", "[0, 1.0]",
              "1e2", "-0.5", "0.75", "${nope}", "${model.d_model}", "*a", "%", "!!binary abc", "&a 3", "a=b", "- 1",
              "? x", "@", "`", "|", "[{layers: [1]}]"]


# every allowed value of every field with a closed set of values (model.flavor: llama, neox; ...)
CHOICES = sorted({str(c) for _, f, _ in config_leaves(Config()) for c in f.metadata.get("choices", ())})


def test_any_value_in_any_field_is_rejected_by_name_or_builds(mesh, request):
  """Any text after ``key=`` for any field (or a malformed key): parsed and accepted, then built (or refused at
  build with a ConfigError naming the key, e.g. Pallas kernels on a host without an accelerator), or rejected with a
  ConfigError that names the key. Accepted values keep the documented types: no nan/inf float, no list of layer or
  head counts with anything but integers in it."""
  counts = {"invalid inputs tried and rejected": 0, "valid inputs built": 0}
  keys = sorted(FIELDS) + GROUPS + ODD_KEYS
  text = st.text(st.characters(min_codepoint=32, max_codepoint=126), max_size=6)

  @PROPERTY
  @given(st.sampled_from(keys), st.sampled_from(RAW_VALUES + CHOICES) | text | st.integers(-3, 100).map(str))
  # regressions, each failing before its fix in config.load_config: a value that is not YAML raised yaml's errors, a
  # list index key TypeError, an interpolation of the wrong type named no field
  @example("model.d_model", "[1")
  @example("train.lr", "*a")
  @example("model.d_model", "%")
  @example("train.lr", "!!binary abc")
  @example("schedule.producers.0", "1")
  @example("schedule.uniattn", "${model.d_model}")
  # ... in config.validate: errors that blamed another field (eval_every, stage1_max_steps, rotary_pct alone)
  @example("train.eval_batches", "-1")
  @example("train.stage1_patience", "0")
  @example("model.head_dim", "3")
  # ... nan/inf and non-integers accepted
  @example("model.rope_low_freq_factor", "nan")
  @example("train.peak_tflops", ".inf")
  @example("distributed.local_device_ids", "[0, x]")
  # ... in kernels.dispatch: Pallas kernels on a host without an accelerator raised a plain ValueError
  @example("attention.impl", "pallas")
  def check(key, raw):
    note(f"override: {key}={raw}")
    try:
      cfg = load_config(None, TINY + [f"{key}={raw}"])
      compile_schedule(cfg.model, cfg.schedule)
    except ConfigError as e:
      assert (key in named_fields(str(e))) if key in FIELDS else (key in str(e)), f"the error does not name {key}: {e}"
      counts["invalid inputs tried and rejected"] += 1
      return
    value = flat_config(cfg).get(key)
    assert key not in FLOAT_FIELDS or finite(value), f"accepted {key}={value!r}"
    assert key not in INT_LIST_FIELDS or all(is_int(x) for x in value), f"accepted {key}={value!r}"
    try:
      build(cfg, mesh)
    except ConfigError as e:  # the config is fine but this host cannot run it
      assert key in named_fields(str(e)), f"the error does not name {key}: {e}"
      event(f"refused at build: {key}={raw}")
    counts["valid inputs built"] += 1

  check()
  report(request, "any value in any field", counts)


def test_seeds_are_accepted_only_where_they_work(request):
  """A seed validation accepts is one the data shuffle (grain) and the parameter initialisation (JAX) take."""
  import grain.python as grain

  counts = {"invalid inputs tried and rejected": 0, "valid inputs built": 0}
  bounds = [0, 1, -1, 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**63 - 1, 2**63, -2**63, -2**63 - 1, 2**64]

  @settings(PROPERTY, max_examples=60)
  @given(st.sampled_from(["data.shuffle_seed", "train.seed"]), st.sampled_from(bounds) | st.integers(-2**70, 2**70))
  # regressions, each failing before its fix in config.validate: grain refuses seeds outside [0, 2**32), JAX
  # outside int64
  @example("data.shuffle_seed", -1)
  @example("data.shuffle_seed", 2**32)
  @example("train.seed", 2**64)
  def check(key, seed):
    try:
      cfg = load_config(None, TINY + [f"{key}={seed}"])
    except ConfigError as e:
      assert key in named_fields(str(e)), e
      counts["invalid inputs tried and rejected"] += 1
      return
    list(grain.MapDataset.range(4).shuffle(seed=cfg.data.shuffle_seed))
    nnx.Rngs(cfg.train.seed).params()
    counts["valid inputs built"] += 1

  check()
  report(request, "seeds", counts)


@pytest.mark.parametrize("field", FLOAT_FIELDS)
@pytest.mark.parametrize("text", ["nan", ".inf", "-inf"])
def test_non_finite_floats_are_rejected_in_every_field(field, text):
  """Every float field, read or not by the configured run, refuses nan and infinities by name."""
  with pytest.raises(ConfigError) as e:
    load_config(None, TINY + [f"{field}={text}"])
  assert field in named_fields(str(e.value)), str(e.value)
