"""HF -> jaxshare import: tiny random transformers models saved locally give the same logits in jaxshare as in
PyTorch on real corpus text, for each architecture option; unsupported configs and unknown tensors are refused."""

import json

import jax
import numpy as np
import pytest
from flax import nnx

from jaxshare.convert.hf_import import load_hf_model
from jaxshare.evaluation.generate import Generator
from jaxshare.convert.mapping import UnsupportedModelError
from jaxshare.model import params as P
from jaxshare.plan import plan_of
from support.hf import HF_CASES, corpus_tokens, save_hf_model
from support.runs import as_run

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


@pytest.mark.parametrize("case", sorted(HF_CASES))
def test_imported_logits_match_pytorch(tmp_path, corpus, case):
  model = save_hf_model(tmp_path, case)
  tokens = corpus_tokens(corpus)
  with torch.no_grad():
    want = model(torch.from_numpy(tokens).long()).logits.numpy()
  setup = load_hf_model(tmp_path)
  cfg, params = setup.cfg, setup.params
  jax_model = nnx.merge(setup.graphdef, params)
  got = np.asarray(jax_model(tokens))
  np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)
  assert np.abs(want).max() > 0.1  # the comparison is not between two near-zero outputs
  prompt = tokens[0, :16].tolist()
  with torch.no_grad():
    continuation = model.generate(torch.tensor([prompt]), max_new_tokens=20, do_sample=False,
                                  pad_token_id=0)[0, 16:].tolist()
  # transformers' generate (its own KV cache) against jaxshare's decode cache: the same greedy continuation
  assert Generator(jax_model, plan_of(cfg)).generate([prompt], 20)[0] == continuation


def test_bf16_checkpoint_imports_exactly_widened(tmp_path, corpus):
  # stored bf16; the PyTorch reference runs the same values in f32
  model = save_hf_model(tmp_path, "llama_gqa", torch.bfloat16)
  tokens = corpus_tokens(corpus)
  with torch.no_grad():
    want = model(torch.from_numpy(tokens).long()).logits.numpy()
  setup = load_hf_model(tmp_path)
  params = setup.params
  np.testing.assert_allclose(np.asarray(nnx.merge(setup.graphdef, params)(tokens)), want, atol=1e-4, rtol=0)


@pytest.mark.parametrize("case,field,value,match", [
  ("llama_gqa", "hidden_act", "gelu_new", "hidden_act='gelu_new' is not supported.*'silu'"),
  ("llama_gqa", "rope_scaling", {"rope_type": "yarn", "factor": 2.0},
   "rope_type='yarn' is not supported.*'default', 'linear', 'llama3'"),
  ("llama_gqa", "attention_bias", True, "attention_bias=True is not supported: .*output projection"),
  ("qwen2_gqa_tied", "use_sliding_window", True, "use_sliding_window=True is not supported: .*per-layer"),
  ("neox_partial_rotary", "hidden_act", "gelu_new", "hidden_act='gelu_new' is not supported.*exact"),
  ("llama_gqa", "architectures", ["FalconForCausalLM"], "architectures='FalconForCausalLM' is not supported; "
   "supported: GPTNeoXForCausalLM, LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM"),
])
def test_unsupported_config_is_refused_by_name(tmp_path, case, field, value, match):
  save_hf_model(tmp_path, case)
  config = json.loads((tmp_path / "config.json").read_text())
  config[field] = value
  if field == "architectures":
    config["model_type"] = "falcon"
  config.pop("rope_parameters", None) if field == "rope_scaling" else None
  (tmp_path / "config.json").write_text(json.dumps(config))
  with pytest.raises(UnsupportedModelError, match=match):
    load_hf_model(tmp_path)


def test_an_import_into_head_wise_sharing_is_refused_with_what_to_do(tmp_path):
  """Head-wise ties are chosen on a dense model's weights when a run is created; an import cannot choose them."""
  save_hf_model(tmp_path, "llama_head_dim")  # multi-head attention: what head-wise sharing ties
  with pytest.raises(UnsupportedModelError, match="ties heads, which an import cannot choose: import the dense"):
    load_hf_model(tmp_path, ["schedule.kind=headwise", "schedule.headwise.ratio=0.3"])


def test_unknown_tensor_is_refused(tmp_path):
  from safetensors.numpy import load_file, save_file

  save_hf_model(tmp_path, "llama_gqa")
  tensors = load_file(tmp_path / "model.safetensors")
  tensors["model.layers.0.self_attn.q_norm.weight"] = np.ones(8, np.float32)
  save_file(tensors, tmp_path / "model.safetensors")
  with pytest.raises(UnsupportedModelError, match="does not map.*q_norm"):
    load_hf_model(tmp_path)


def test_cli_import_writes_a_run_that_eval_and_uptraining_read(tmp_path, corpus):
  import jax

  from conftest import tiny_config
  from jaxshare.convert.__main__ import main
  from jaxshare.data import Datasets
  from jaxshare.evaluation.evaluate import evaluate_run
  from jaxshare.train.loop import train
  from jaxshare.store.runs import load_run

  hf, run = tmp_path / "hf", tmp_path / "run"
  model = save_hf_model(hf, "neox_partial_rotary")
  assert main(["import", str(hf), str(run), "data.seq_len=32"]) == 0
  want = load_hf_model(hf).params  # anonymous memory here, disk-backed in the CLI: the same values
  loaded = load_run(run)
  cfg, params, step = loaded.cfg, loaded.params, loaded.step
  assert step == 0 and cfg.model.flavor == "neox" and cfg.model.rotary_pct == 0.25
  jax.tree.map(np.testing.assert_array_equal, params, want)
  assert sorted(p.name for p in tmp_path.iterdir()) == ["hf", "run"]  # the disk-backed scratch arrays are gone
  assert np.isfinite(evaluate_run(run, max_batches=2, sample_tokens=4)["val_loss"])

  # uptraining from it: the first step's loss (computed before the update) is PyTorch's loss on that batch
  up = tiny_config("train.steps=1", "train.warmup_steps=0", "train.log_every=1", "train.eval_every=0",
                   "train.batch_size=4",
                   f"train.init_from={run}", f"train.run_dir={tmp_path / 'up'}",
                   *[f"model.{k}={v}" for k, v in (("flavor", "neox"), ("num_layers", 3), ("d_model", 32),
                                                   ("mlp_dim", 64), ("rotary_pct", 0.25))])
  summary = train(up)
  batch = next(Datasets(up.data, up.train.batch_size).train_iter())
  with torch.no_grad():
    logits = model(torch.from_numpy(batch.inputs).long()).logits
    want_loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), torch.from_numpy(batch.targets).long()
                                                  .flatten()).item()
  assert batch.loss_mask.all()
  assert abs(summary["loss"] - want_loss) < 1e-4, (summary["loss"], want_loss)


def test_cli_refuses_bad_input_with_exit_code_2(tmp_path, capsys):
  from jaxshare.convert.__main__ import main

  (tmp_path / "hf").mkdir()
  assert main(["import", str(tmp_path / "hf"), str(tmp_path / "run")]) == 2
  assert "no config.json" in capsys.readouterr().err
  assert not (tmp_path / "run").exists()


def test_a_converted_run_trains_in_its_own_directory(tmp_path):
  """write_run stores parameters only; training in that directory starts a fresh optimizer from them at step 0,
  exactly as train.init_from=<that run> does in a new directory."""
  from conftest import tiny_config
  from jaxshare.store.runs import write_run
  from jaxshare.train.loop import train
  from jaxshare.train.state import init_state, setup_training

  cfg = tiny_config("train.steps=3", "train.eval_every=3", "train.checkpoint_every=3")
  setup = setup_training(cfg)
  write_run(tmp_path / "in_place", as_run(cfg, jax.tree.map(np.asarray, init_state(setup, seed=5).params)))
  in_place = train(tiny_config("train.steps=3", "train.eval_every=3", "train.checkpoint_every=3",
                               f"train.run_dir={tmp_path / 'in_place'}"))
  fresh_dir = train(tiny_config("train.steps=3", "train.eval_every=3", "train.checkpoint_every=3",
                                f"train.run_dir={tmp_path / 'new'}", f"train.init_from={tmp_path / 'in_place'}/checkpoints/0"))
  assert in_place["step"] == fresh_dir["step"] == 3
  np.testing.assert_allclose(in_place["val_loss"], fresh_dir["val_loss"], rtol=1e-5)


def test_directshare_ties_the_heads_of_an_imported_model(tmp_path, capsys):
  """DirectShare on an imported HF model: ties selected on the imported weights, every tied head's W_q/W_k/W_v the
  imported weights of its representative (a stored row holds its own head's imported weights)."""
  from jaxshare.convert.__main__ import main
  from jaxshare.model.ties import MATRICES
  from jaxshare.store.runs import load_run

  hf, run, tied = tmp_path / "hf", tmp_path / "run", tmp_path / "tied"
  save_hf_model(hf, "llama_head_dim")  # MHA (head-wise sharing ties bias-free projections)
  assert main(["import", str(hf), str(run), "data.seq_len=32"]) == 0
  assert main(["uptrain", str(run), str(tied), "schedule.kind=headwise", "schedule.headwise.ratio=0.3"]) == 0
  assert "DirectShare" in capsys.readouterr().out
  src_setup = load_run(run)
  src = src_setup.params
  setup = load_run(tied)
  params = setup.params
  assert setup.ties is not None and setup.schedule.tied_heads == round(0.3 * 4 * 3 * 4 / 3)
  for m in MATRICES:
    table = np.asarray(params["head_table"][m])
    for row, (layer, head) in enumerate(setup.ties.rows[m]):
      kernel = np.asarray(P.layer_params(src, src_setup.schedule, layer)["attn"][f"{m}_proj"]["kernel"])
      np.testing.assert_array_equal(table[row], kernel[:, head, :])
    assert len(setup.ties.rows[m]) == 3 * 4 - setup.schedule.tied_heads


def test_analysis_cli_reads_an_imported_run(tmp_path, corpus, capsys):
  """python -m jaxshare.analysis on an imported Mistral (sliding window shorter than the windows analysed)."""
  from jaxshare.analysis.__main__ import main as analyse
  from jaxshare.convert.__main__ import main

  hf, run, out = tmp_path / "hf", tmp_path / "run", tmp_path / "out"
  save_hf_model(hf, "mistral_window")
  assert main(["import", str(hf), str(run), "data.seq_len=32"]) == 0
  assert analyse([str(run), "--text", str(corpus), "--out", str(out), "--samples", "2", "--seq-len", "16"]) == 0
  assert "2 windows of 16 tokens" in capsys.readouterr().out
  assert (out / "js_divergence.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
