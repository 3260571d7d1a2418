"""The lm-evaluation-harness adapter on a local task built from the corpus (the hub is unreachable): its
loglikelihoods equal jaxshare's own forward pass, rolling loglikelihoods cover every token once, generate_until
stops at its strings, and ``simple_evaluate`` runs the task end to end."""

import os

import jax
import numpy as np
import pytest
from flax import nnx

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

from conftest import CORPUS, tiny_config, write_multiple_choice_task  # noqa: E402
from jaxshare.store.runs import write_run  # noqa: E402
from jaxshare.evaluation.lm_eval_harness import JaxshareLM  # noqa: E402
from support.models import randomized  # noqa: E402
from support.runs import as_run


class Request:
  def __init__(self, *args):
    self.args = args


@pytest.fixture(scope="module")
def run(tmp_path_factory):
  cfg = tiny_config("schedule.kind=uniattn", "schedule.uniattn.block_size=2")
  _, graphdef, params = randomized(cfg)
  run_dir = tmp_path_factory.mktemp("lm_eval") / "run"
  write_run(run_dir, as_run(cfg, params))
  return run_dir, graphdef, params


def _own_logprob(graphdef, params, ids, n_cont):
  """log p of the last ``n_cont`` tokens of ``ids`` from one unpadded forward pass."""
  logits = nnx.merge(graphdef, params)(np.asarray(ids[:-1], np.int32)[None])[0]
  logp = jax.nn.log_softmax(logits, -1)
  return float(sum(logp[t, ids[t + 1]] for t in range(len(ids) - 1 - n_cont, len(ids) - 1)))


def test_loglikelihoods_equal_jaxshare_forward(run):
  run_dir, graphdef, params = run
  lm = JaxshareLM(run=str(run_dir), batch_size=3)
  pairs = [("ROMEO:\n", "What light"), ("", "Hello"), ("JULIET: ", "O Romeo"), ("A" * 50, "BC")]
  got = lm.loglikelihood([Request(*p) for p in pairs])
  assert len(got) == 4
  for (ctx, cont), (logp, _) in zip(pairs, got):
    ctx_ids, cont_ids = lm._encode_pair(ctx, cont)
    assert lm.tokenizer.decode(ctx_ids + cont_ids).lstrip("\x00") == ctx + cont
    want = _own_logprob(graphdef, params, (ctx_ids + cont_ids)[-(lm.max_length + 1):], len(cont_ids))
    assert logp == pytest.approx(want, abs=1e-4)
  assert lm._encode_pair("JULIET: ", "O")[1] == lm.tokenizer.encode(" O")  # the space moves to the continuation
  text = CORPUS.read_text()[:30]  # one window: every token scored given EOS and the tokens before it
  ids = [lm.tokenizer.eos_id] + lm.tokenizer.encode(text)
  rolling = lm.loglikelihood_rolling([Request(text)])[0]
  assert rolling == pytest.approx(_own_logprob(graphdef, params, ids, len(ids) - 1), abs=1e-4)
  long = lm.loglikelihood_rolling([Request(CORPUS.read_text()[:150])])[0]  # several windows of max_length=32
  assert long < rolling < 0


def test_generate_until_stops_at_its_strings(run):
  run_dir, graphdef, params = run
  lm = JaxshareLM(run=str(run_dir), batch_size=2)
  free = lm.generate_until([Request("ROMEO:", {"max_gen_toks": 12})])[0]
  assert len(free.encode("utf-8", "surrogateescape")) <= 12 * 4
  stop = free[3:5]
  cut = lm.generate_until([Request("ROMEO:", {"max_gen_toks": 12, "until": [stop]}),
                           Request("JULIET:", {"max_gen_toks": 12})])
  assert cut[0] == free[:free.index(stop)]


def test_simple_evaluate_runs_a_local_multiple_choice_task(run, tmp_path):
  """A next-line multiple-choice task from the corpus (YAML + JSONL), evaluated through the harness."""
  from lm_eval import simple_evaluate
  from lm_eval.tasks import TaskManager

  run_dir, _, _ = run
  lines = [ln for ln in CORPUS.read_text().splitlines() if len(ln) > 20][:40]
  rng = np.random.default_rng(0)
  docs = []
  for i in range(0, 16):
    others = [lines[j] for j in rng.choice([j for j in range(len(lines)) if j != i + 1], 3, replace=False)]
    choices = [lines[i + 1], *others]
    order = rng.permutation(4)
    docs.append({"context": lines[i], "choices": [choices[k] for k in order],
                 "label": int(np.flatnonzero(order == 0)[0])})
  write_multiple_choice_task(tmp_path, "shakespeare_next_line", docs)
  results = simple_evaluate(model="jaxshare", model_args=f"run={run_dir},batch_size=8",
                            tasks=["shakespeare_next_line"],
                            task_manager=TaskManager(include_path=str(tmp_path), include_defaults=False))
  acc = results["results"]["shakespeare_next_line"]["acc,none"]
  lm = JaxshareLM(run=str(run_dir))
  own = [np.argmax([p for p, _ in lm.loglikelihood([Request(d["context"] + "\n", " " + c) for c in d["choices"]])])
         == d["label"] for d in docs]
  assert acc == pytest.approx(np.mean(own))  # the harness scored the task with the adapter's loglikelihoods
