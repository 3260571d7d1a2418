"""Every published table marked as rendered comes from the committed result files (issue 63 part 4): rendering
results/ again changes no page; the uptraining table computes its cells from the row files as its caption says
(mean ± sample std over the seeds recorded, differences paired by seed, a shared conversion named, the commits
measured at); a hand-edited cell or a marker without files is caught."""

import importlib.util
import json

import pytest

from conftest import REPO


def _load(name: str):
  spec = importlib.util.spec_from_file_location(name, REPO / "scripts" / f"{name}.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


render_results = _load("render_results")
experiment = _load("uptrain_experiment")


def test_the_pages_tables_are_their_result_files():
  assert render_results.main(["--check"]) == 0


def _result(values: dict, commit: str = "a" * 40, dirty: bool = False) -> dict:
  return {**values, "provenance": {"commands": [["python", "train.py"]], "commit": commit, "dirty": dirty,
                                   "jax": "0", "flax": "0", "date": "2026-12-02", "measure": "m"}}


def _write(path, data):
  path.parent.mkdir(parents=True, exist_ok=True)
  path.write_text(json.dumps(data))


def _sizes(kv: int) -> dict:
  return {"schedule": "s", "num_params": 100, "kv_bytes_per_token_bf16": kv}


@pytest.fixture
def results(tmp_path):
  root = tmp_path / "uptrain"
  _write(root / "settings.json", {"experiment": "e", "dense_steps": 600, "steps": 150, "uptrain_lr": 0.001,
                                  "wc_fit": "tokens"})
  _write(root / "source.json", _result({"val_loss": 1.7, "dense_val_loss": 1.7, **_sizes(4096)}))
  rows = root / "rows"
  _write(rows / "dense.json", {"conversion_of": "dense", "conversion": ["schedule.kind=dense"], "sizes": _sizes(4096),
                               "converted": _result({"val_loss": 1.7}),
                               "uptrained": {str(s): _result({"val_loss": v}) for s, v in enumerate([1.6, 1.62, 1.64])},
                               "scratch": {"0": _result({"val_loss": 2.2})}})
  _write(rows / "uniattn.json", {"conversion_of": "uniattn", "conversion": ["schedule.kind=uniattn"],
                                 "sizes": _sizes(3584),
                                 "converted": _result({"val_loss": 1.9, "fits": ["W_c fit:", "  layer 5: 37 -> 4"]}),
                                 # seeds 0 and 2 only: paired with the control's seeds 0 and 2
                                 "uptrained": {"0": _result({"val_loss": 1.7}),
                                               "2": _result({"val_loss": 1.8}, commit="b" * 40, dirty=True)}})
  _write(rows / "uniattn_2stage.json", {"conversion_of": "uniattn", "conversion": ["schedule.kind=uniattn"],
                                        "sizes": _sizes(3584),
                                        "uptrained": {"0": _result({"val_loss": 1.75, "stage1_steps": 50})}})
  return root


def test_the_uptraining_table_is_computed_from_its_row_files(results):
  lines = experiment.render(results)
  rows = {line.split(" (")[0].strip("| "): line for line in lines if line.startswith("| ")}
  assert "at seeds 0, 1, 2" in lines[0]
  assert rows["dense"].startswith("| dense (`schedule.kind=dense`) |")  # the conversion its file records
  assert rows["start"].startswith("| start (the dense source after export to HF and import) |")
  assert rows["dense"].split(" | ")[3:] == ["1.7000", "1.6200 ± 0.0200", "—", "2.2000", "3 |"]
  # the mean and std of 1.7 and 1.8; paired: 1.7 - 1.6 and 1.8 - 1.64
  assert rows["uniattn"].split(" | ")[3:] == ["1.9000", "1.7500 ± 0.0707", "+0.1300 ± 0.0424", "—", "2 |"]
  assert rows["uniattn_2stage"].split(" | ")[0].endswith(
    "uniattn with train.recipe=uniattn_two_stage train.stage1_max_steps=50")
  assert rows["uniattn_2stage"].split(" | ")[3] == "= uniattn"  # its conversion's cell is not copied
  assert any(line.startswith("uniattn_2stage: stage 1") and "ran 50 steps at seeds 0" in line for line in lines)
  # the one-change table: the recipe row against its twin at the seed both have (1.75 - 1.7), and what uptraining
  # gains over training from scratch at the seed both have (1.6 - 2.2)
  paired_lines = experiment.render_paired(results)
  assert paired_lines[-1] == lines[-1]  # the same files, measured at the same commits
  assert paired_lines[-7:-2] == ["```", "uniattn:", "W_c fit:", "  layer 5: 37 -> 4", "```"]  # its conversion's fits
  paired = [line for line in paired_lines if line.startswith("| uniattn_2stage | uniattn |") or
            line.startswith("| dense | dense from scratch |")]
  assert paired == ["| uniattn_2stage | uniattn | train.recipe=uniattn_two_stage train.stage1_max_steps=50 | "
                    "+0.0500 | 1 |", "| dense | dense from scratch | uptrained from its conversion | -0.6000 | 1 |"]
  assert lines[-1].endswith("measured at commits aaaaaaa, bbbbbbb+ (+: with uncommitted changes; each cell's "
                            "commands, commit, jax and flax versions and date are in its row's file).")


def test_a_hand_edited_cell_and_a_marker_without_files_are_caught(results):
  table = "\n".join(experiment.render(results)) + "\n"
  page = ("text\n<!-- rendered from results/uptrain: begin -->\n" + table.replace("1.6200", "1.6100")
          + "<!-- rendered from results/uptrain: end -->\nmore\n")
  fixed = render_results.rendered(page, {"uptrain": table})
  assert fixed != page and "1.6200 ± 0.0200" in fixed and fixed.startswith("text\n") and fixed.endswith("more\n")
  assert render_results.rendered(fixed, {"uptrain": table}) == fixed
  with pytest.raises(SystemExit, match="results/sharing, which has no result files"):
    render_results.rendered(page.replace("results/uptrain", "results/sharing"), {"uptrain": table})
  # a second table of the same files, under its own marker, leaves the first's alone
  paired = "\n".join(experiment.render_paired(results)) + "\n"
  begin, end = ("<!-- rendered from results/uptrain#paired: begin -->\n",
                "<!-- rendered from results/uptrain#paired: end -->\n")
  twice = render_results.rendered(f"{fixed}{begin}old\n{end}", {"uptrain": table, "uptrain#paired": paired})
  assert twice == f"{fixed}{begin}{paired}{end}"


def test_the_search_table_has_one_row_per_summary_in_the_readmes_order(tmp_path):
  def summary(budget, winner, preset, finals):
    return _result({"budget": budget, "candidates": 9, "presets": 4, "kvsharer": 2, "stage1_best": ["gqa2", 2.5123],
                    "rung0_steps": 25, "rung0": {"cla2-own": 2.1, "gqa2": 2.3}, "final_steps": 100, "finals": finals,
                    "winner": winner, "best_preset": preset,
                    "kv_bytes_per_token_bf16": {n: 2048 for n in finals}, "rho": [-0.8, 4]})

  _write(tmp_path / "kv25.json", summary("KV <= 1,024 B/token", "mlkv2-own", "mlkv2-mean",
                                         {"mlkv2-own": [2.0, 2.01], "mlkv2-mean": [2.05, 2.06]}))
  _write(tmp_path / "kv50.json", summary("KV <= 2,048 B/token", "cla2-own", "cla2-own", {"cla2-own": [1.88, 1.89]}))
  lines = render_results._search()(tmp_path)
  rows = [line for line in lines[2:] if line.startswith("| ")]
  assert [r.split(" | ")[0] for r in rows] == ["| KV <= 2,048 B/token", "| KV <= 1,024 B/token"]  # kv50 first
  assert rows[0] == ("| KV <= 2,048 B/token | 9 (4 presets, 2 KVSharer) | `gqa2` 2.512 | 25 steps: `cla2-own` 2.100, "
                     "`gqa2` 2.300 | `cla2-own` 1.8850 ± 0.0071 (2,048 B/token, 2 seeds × 100 steps) | (the winner) | "
                     "-0.80 (4 candidates) |")
  assert "`mlkv2-mean` 2.0550 ± 0.0071" in rows[1]
  assert lines[-1].startswith("Rendered by scripts/render_results.py from results/search/ (kv50.json, kv25.json)")


def test_a_published_sweep_renders_its_variants_in_order_over_seeds(tmp_path):
  """A directory a sweep published (sweep.json: scripts/sweep.py --results) renders through the sweep's renderer:
  its variants in the sweep file's order (not the files' names), the loss as mean ± sample std over seeds; a row
  of a variant sweep.json does not list is refused."""
  root = tmp_path / "sharing"
  _write(root / "sweep.json", {"sweep": "configs/sweeps/sharing_table.yaml", "experiment": "e", "base": [],
                               "variants": [["zeta", []], ["alpha", ["schedule.kind=cla"]]]})
  for name, seed, loss in [("alpha", 0, 1.80), ("alpha", 1, 1.82), ("zeta", 0, 1.75)]:
    _write(root / "rows" / f"{name}-seed{seed}.json",
           _result({"variant": name, "seed": seed, "val_loss": loss, "kv_bytes_per_token_bf16": 2048, "num_params": 9}))
  table = render_results.render_all(tmp_path)["sharing"].splitlines()
  assert table[2:4] == ["| zeta | (the experiment as it is) | 0 | 1.7500 | 2,048 | 9 |",
                        "| alpha | `schedule.kind=cla` | 0, 1 | 1.8100 ± 0.0141 | 2,048 | 9 |"]
  assert "python scripts/sweep.py configs/sweeps/sharing_table.yaml --results" in table[-1] and "3 runs" in table[-1]
  _write(root / "rows" / "beta.json", _result({"variant": "beta", "seed": None, "val_loss": 1.0}))
  with pytest.raises(ValueError, match="variant 'beta' is not one of"):
    render_results.render_all(tmp_path)


def test_a_fit_table_renders_one_column_per_schedule_from_rows_of_several_commands(tmp_path):
  """A directory holding fit.json (scripts/fit_table.py --results) renders as the fit table: a column per schedule,
  per case the largest batch with its HBM (none when one sequence per shard does not fit), the step-time bound of
  the compile reported and, where K/V moved between chips, those bytes (per sequence too where a batch fits) and
  every collective's; the decode
  cache once per length (and model, where the table has several); a missing cell is a dash; a row published again replaces its case's; the footer names every
  command and commit."""
  from jaxshare.aot.fit_results import publish

  root = tmp_path / "long"
  gib = 2 ** 30

  def row(schedule, target, context, batch, hbm, kv, ring=False, bound=1.0):
    return {"model": "M", "target": target, "schedule": schedule, "remat": "full", "seq_len": 131072,
            "context": context, "ring": ring, "chips": context, "batch": batch, "hbm": hbm * gib,
            "kv_moved": kv * gib if kv is not None else None, "moved": (kv + 10) * gib if kv is not None else None,
            "step_time_bound_s": bound, "decode_kv_cache": (16 if schedule == "dense" else 8) * gib, "compiles": 3}

  one, two = (_result({}, commit=c)["provenance"] for c in ("a" * 40, "b" * 40))
  two = {**two, "commands": [["python", "scripts/fit_table.py", "ring"]]}
  publish(root, row("dense", "h100:1", 1, 2, 50, None), one)
  publish(root, row("cla2", "h100:1", 1, 1, 60, None), one)
  publish(root, row("cla2", "h100:1", 1, 2, 40, 0), one)  # again: replaces the row before; no K/V moved: no K/V line
  publish(root, row("dense", "h100:8", 8, None, 90, 168, ring=True), two)
  publish(root, row("cla2", "h100:8", 8, 2, 40, 84, ring=True, bound=12.3456), two)
  table = render_results.render_all(tmp_path)["long"].splitlines()
  ring = "M, 131,072 tokens, h100:8, mesh.context=8 round the ring (`attention.context_strategy=ring`), `model.remat=full`"
  assert table[:9] == [
    "| case | dense | cla2 |", "|---|---|---|",
    "| M, 131,072 tokens, h100:1, `model.remat=full`: largest batch (HBM per chip) | 2 (50.00 GiB) | 2 (40.00 GiB) |",
    "| M, 131,072 tokens, h100:1, `model.remat=full`: step-time bound at that batch | 1,000 ms | 1,000 ms |",
    "| decode KV cache per 131,072-token sequence | 16.00 GiB | 8.00 GiB |",
    f"| {ring}: largest batch (HBM per chip) | none (90.00 GiB for one sequence per shard) | 2 (40.00 GiB) |",
    f"| {ring}: step-time bound at that batch | 1,000 ms | 12,346 ms |",
    f"| {ring}: K/V bytes moved per chip per step | 168.00 GiB | 84.00 GiB (42.00 GiB per sequence) |",
    f"| {ring}: all collectives' bytes per chip per step | 178.00 GiB | 94.00 GiB |"]
  assert table[-1].endswith("made by `python train.py`, `python scripts/fit_table.py ring`; compiled at commits "
                            "aaaaaaa, bbbbbbb with jax 0.")
  # another model at a length already shown has decode caches of its own: a line of its own, named by the model
  publish(root, {**row("dense", "h100:8", 8, 1, 40, 42), "model": "N", "decode_kv_cache": 4 * gib}, two)
  table = render_results.render_all(tmp_path)["long"].splitlines()
  assert "| decode KV cache per 131,072-token sequence of M | 16.00 GiB | 8.00 GiB |" in table
  assert "| decode KV cache per 131,072-token sequence of N | 4.00 GiB | — |" in table


def test_the_policy_parity_table_renders_each_schedule_against_dense_at_one_batch(tmp_path):
  """results/fit_parity_policies renders against dense (issue 61 part 5): per topology, length and policy dense's HBM,
  then each schedule's difference from it in GiB (a compile over the chip's memory says so; a missing cell is a dash);
  a line without dense, or rows of two batches compared, is refused by name."""
  from jaxshare.aot.fit_results import publish

  root = tmp_path / "fit_parity_policies"

  def row(schedule, target, remat, hbm, batch=1):
    return {"model": "M", "target": target, "schedule": schedule, "remat": remat, "seq_len": 32768, "context": 1,
            "ring": False, "chips": int(target[-1]), "batch": batch, "hbm": int(hbm * 2 ** 30), "kv_moved": None,
            "moved": None, "step_time_bound_s": 1.0, "decode_kv_cache": 2 ** 30, "compiles": 1}

  made = _result({})["provenance"]
  for r in (row("dense", "h100:1", "minimal", 48.03), row("cla2", "h100:1", "minimal", 47.54),
            row("mlkv", "h100:1", "minimal", 41.08), row("dense", "h100:8", "save_out_proj", 10.95),
            row("cla2", "h100:8", "save_out_proj", 11.43, batch=None)):
    publish(root, r, made)
  table = render_results.render_all(tmp_path)["fit_parity_policies"].splitlines()
  assert table[:4] == ["| topology | T | model.remat | dense | cla2 | mlkv |", "|---|---|---|---|---|---|",
                       "| h100:1 | 32,768 | minimal | 48.03 GiB | -0.49 | -6.95 |",
                       "| h100:8 | 32,768 | save_out_proj | 10.95 GiB | +0.48 (does not fit) | — |"]
  assert table[-1].startswith(f"Rendered by scripts/render_results.py from {root}/fit.json, made by `python train.py`")
  publish(root, row("cla2", "h100:8", "save_out_proj", 11.43, batch=2), made)
  with pytest.raises(ValueError, match=r"compares batches \[1, 2\] at \('h100:8', 32768, 'save_out_proj'\)"):
    render_results.render_all(tmp_path)
  publish(root, row("cla2", "h100:8", "save_out_proj", 11.43), made)
  publish(root, row("mlkv", "h100:8", "full", 9.0), made)
  with pytest.raises(ValueError, match=r"no dense row for \('h100:8', 32768, 'full'\)"):
    render_results.render_all(tmp_path)


def test_the_remat_policy_table_renders_memory_flops_and_compile_time_per_policy(tmp_path):
  """results/fit_policies (scripts/fit_table.py --policies --results) renders a line per topology, length and policy
  in the order compiled: HBM per chip (a compile over the chip's memory says so), the executed FLOPs of the step and
  their ratio to the model's (recomputation's cost), the compile's seconds; then the command and commit."""
  from jaxshare.aot.fit_results import publish

  root = tmp_path / "fit_policies"

  def row(target, length, remat, hbm, executed, batch=1):
    return {"model": "llama_1b_h100", "target": target, "schedule": "dense", "remat": remat, "seq_len": length,
            "context": 1, "ring": False, "chips": 1, "batch": batch, "hbm": int(hbm * 2 ** 30), "kv_moved": None,
            "moved": None, "step_time_bound_s": 1.0, "decode_kv_cache": 2 ** 30, "compiles": 1,
            "model_flops": 7.0e13, "executed_flops": executed, "compile_s": 4.6}

  made = _result({})["provenance"]
  for r in (row("h100:1", 8192, "none", 26.14, 7.112e13), row("h100:1", 8192, "full", 19.25, 8.442e13),
            row("v5p-8", 32768, "none", 99.0, 7.07e13, batch=None)):
    publish(root, r, made)
  table = render_results.render_all(tmp_path)["fit_policies"].splitlines()
  assert table[:5] == [
    "| topology | T | model.remat | HBM per chip | executed FLOPs per step | executed / model FLOPs | compile s |",
    "|---|---|---|---|---|---|---|",
    "| h100:1 | 8,192 | none | 26.14 GiB | 7.112e+13 | 1.016 | 5 |",
    "| h100:1 | 8,192 | full | 19.25 GiB | 8.442e+13 | 1.206 | 5 |",
    "| v5p-8 | 32,768 | none | 99.00 GiB (does not fit) | 7.070e+13 | 1.010 | 5 |"]
  assert table[-1].startswith(f"Rendered by scripts/render_results.py from {root}/fit.json, made by `python train.py`")


def test_a_benchmarks_table_renders_as_printed_with_its_command(tmp_path):
  """A directory holding table.json (a benchmark's --results) renders as the lines it printed, then its command,
  commit, date and measure."""
  _write(tmp_path / "compile" / "table.json", _result({"lines": ["| a | b |", "|---|---|", "| 1 | 2 |"]}))
  assert render_results.render_all(tmp_path)["compile"].splitlines() == [
    "| a | b |", "|---|---|", "| 1 | 2 |", "",
    f"Rendered by scripts/render_results.py from {tmp_path / 'compile'}/table.json: `python train.py` at commit "
    "aaaaaaa on 2026-12-02 (jax 0); m."]
