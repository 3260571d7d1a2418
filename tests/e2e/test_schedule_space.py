"""Any valid schedule works through every stage a user runs it through. Drawn over every preset and '+'
composition, 2-8 layers, MHA/GQA/MQA and both flavours (the strategy of ``test_properties.py``, whose own test
proves that invalid ones are refused naming the field before anything compiles), each valid schedule trains one
step with a finite loss, evaluates, generates 4 tokens with the decode cache exactly as without it, and round-trips
through export and import bit for bit.

The budget is small in CI (``JAXSHARE_SCHEDULE_EXAMPLES``, default 4: each example compiles a train step, an
evaluation and two decoders); raise it for a longer search, e.g. ``JAXSHARE_SCHEDULE_EXAMPLES=100``.
"""

import os

import jax
import numpy as np
from flax import nnx, traverse_util
from hypothesis import HealthCheck, given, note, settings
from hypothesis import strategies as st

from conftest import TINY
from jaxshare.config import load_config
from jaxshare.convert.hf_export import export_run
from jaxshare.convert.hf_import import load_hf_model
from jaxshare.evaluation.evaluate import evaluate_run
from jaxshare.evaluation.generate import Generator
from jaxshare.train.loop import train
from jaxshare.store.runs import load_run
from support.schedule_oracle import oracle, overrides, schedule_specs

EXAMPLES = int(os.environ.get("JAXSHARE_SCHEDULE_EXAMPLES", "4"))
ONE_STEP = ["train.steps=1", "train.checkpoint_every=1", "train.log_every=1", "train.eval_every=1",
            "train.eval_batches=1", "train.warmup_steps=0", "train.peak_tflops=0.1", "data.seq_len=16"]


@st.composite
def valid_schedules(draw):
  return draw(schedule_specs(layers=(2, 8)).filter(lambda s: not oracle(s).violations))


def flat(params) -> dict:
  return {"/".join(map(str, k)): np.asarray(v) for k, v in traverse_util.flatten_dict(params).items()}


@settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None, print_blob=False,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
@given(valid_schedules())
def test_any_valid_schedule_trains_evaluates_generates_and_round_trips(tmp_path_factory, spec):
  argv = overrides(spec)[len(TINY):]
  note(f"overrides: {argv}")
  run = tmp_path_factory.mktemp("schedule") / "run"
  cfg = load_config(None, TINY + argv + ONE_STEP + [f"train.run_dir={run}"])
  summary = train(cfg)
  assert summary["step"] == 1 and np.isfinite(summary["loss"]) and np.isfinite(summary["val_loss"])

  report = evaluate_run(run, max_batches=1, sample_tokens=0)
  assert np.isfinite(report["val_loss"])

  setup = load_run(run)

  cfg, params = setup.cfg, setup.params
  generator = Generator(nnx.merge(setup.graphdef, params), setup.plan)
  prompts = [[5, 6, 7], [9, 10, 11, 12, 13]]  # rows of different lengths: left padding
  cached = generator.generate(prompts, 4, stop_tokens=[-1])
  assert cached == generator.generate(prompts, 4, stop_tokens=[-1], use_cache=False)
  assert [len(row) for row in cached] == [4, 4]

  out = run.parent / "exported"
  export_run(run, out)
  model = load_hf_model(out)
  imported = model.params
  want, got = flat(jax.device_get(params)), flat(imported)
  assert sorted(got) == sorted(want)
  for name, value in want.items():
    np.testing.assert_array_equal(np.asarray(got[name]), value, err_msg=name)
