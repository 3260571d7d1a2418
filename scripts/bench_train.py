"""Training throughput of jaxshare against the PyTorch tools a researcher would otherwise use, side by side.

Every contestant is a worker process that builds its model, compiles and warms up, then waits; the parent runs them
**interleaved** (round r: each worker trains ``--steps`` steps in turn, alone on the machine, starting from the r-th
so that every contestant runs in every slot), so drifts of clock speed or load hit all contestants alike. Compilation and warm-up are excluded. Synthetic byte-level batches, fp32,
AdamW with clipping, the same thread count (every core) for XLA and PyTorch.

  python scripts/bench_train.py                               # all shapes, dense
  python scripts/bench_train.py --shapes default --schedules dense,cla2,mlkv,sa,uniattn,lisa_plus
  python scripts/bench_train.py --shapes default --nanogpt ~/src/nanoGPT   # calibrate against nanoGPT itself

``--end-to-end`` adds a row for ``train.py`` itself at each shape (dense, the real corpus, its data pipeline, logging
and checkpoints; validation off): its own tokens/s over its log intervals after the first, which holds compilation,
against the shape's first peer training the same number of steps, the two alternating for ``--rounds`` rounds.

``--nanogpt CHECKOUT`` calibrates the nanoGPT-style contestant, which trains jaxshare's Llama layer in nanoGPT's
structure, at the shapes where it races: the same contestant with nanoGPT's GPT-2 layer (``nanogpt_gpt2``: the same
math as nanoGPT) races nanoGPT's own model and optimizer (``model.py`` of that checkout, run, not copied), and each
nanoGPT-style row prints its speed relative to nanoGPT's. Built and trained as nanoGPT is, ``nanogpt_gpt2`` should run
at nanoGPT's speed; the Llama-layer row then says what the layer itself costs.

Prints per shape: tokens/s of each contestant (median over rounds), jaxshare's ratio to each peer (median and range
over rounds), jaxshare's model GFLOP/s, and the matmul roofline of XLA (jaxshare rows) and of PyTorch (peer rows),
each measured on the model's own matmul shapes: if PyTorch's GEMMs are as fast as XLA's, no XLA step can beat the
peer by more than the non-matmul time it saves.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import yaml

ROOT = Path(__file__).resolve().parents[1]

# name: dims, the PyTorch peers to race, and whether jaxshare is Llama- or NeoX-flavoured.
SHAPES = {
  "default": dict(flavor="llama", layers=4, d=128, heads=4, mlp=384, vocab=256, seq_len=128, batch=32,
                  rotary_pct=1.0, theta=10000.0, peers=("nanogpt",)),
  "6x256_llama": dict(flavor="llama", layers=6, d=256, heads=4, mlp=688, vocab=256, seq_len=256, batch=8,
                      rotary_pct=1.0, theta=10000.0, peers=("hf_llama",)),
  "6x256_neox": dict(flavor="neox", layers=6, d=256, heads=4, mlp=1024, vocab=256, seq_len=256, batch=8,
                     rotary_pct=0.25, theta=10000.0, peers=("hf_neox",)),
  "20m_llama": dict(flavor="llama", layers=6, d=512, heads=8, mlp=1376, vocab=256, seq_len=256, batch=8,
                    rotary_pct=1.0, theta=10000.0, peers=("hf_llama",)),
}

# Read from this tree's catalogue without importing jaxshare: a worker imports the jaxshare of the tree it measures
# (--compare-tree), which may predate the catalogue.
SCHEDULES = yaml.safe_load((ROOT / "configs" / "schedule_catalogue.yaml").read_text())["matrices"][
  "script_bench_train"]


def synthetic_batches(shape: dict, n: int = 4) -> list[tuple[np.ndarray, np.ndarray]]:
  """``n`` (inputs, targets) pairs of ``[batch, seq_len]`` int32 bytes, identical for every contestant."""
  rng = np.random.default_rng(0)
  out = []
  for _ in range(n):
    seq = rng.integers(0, shape["vocab"], (shape["batch"], shape["seq_len"] + 1), dtype=np.int32)
    out.append((seq[:, :-1], seq[:, 1:]))
  return out


def one_document_rows(inputs: np.ndarray, targets: np.ndarray):
  """The train step's :class:`~jaxshare.data.batch.Batch` for ``[batch, seq_len]`` int32 inputs and targets, one
  document per row and every target counted."""
  fields = {"inputs": inputs, "targets": targets,
            "positions": np.broadcast_to(np.arange(inputs.shape[1], dtype=np.int32), inputs.shape),
            "segment_ids": np.ones_like(inputs), "loss_mask": np.ones_like(inputs)}
  try:
    from jaxshare.data.batch import Batch
  except ImportError:  # a --compare-tree checkout from before the typed batch takes the dict
    return fields
  return Batch.of(fields)


def jax_overrides(shape: dict, schedule: str) -> list[str]:
  return [f"model.flavor={shape['flavor']}", f"model.num_layers={shape['layers']}", f"model.d_model={shape['d']}",
          f"model.num_heads={shape['heads']}", f"model.mlp_dim={shape['mlp']}", f"model.vocab_size={shape['vocab']}",
          f"model.rotary_pct={shape['rotary_pct']}", f"model.rope_theta={shape['theta']}",
          f"data.seq_len={shape['seq_len']}", f"train.batch_size={shape['batch']}", "train.steps=100000",
          "model.dtype=float32", "model.param_dtype=float32", *SCHEDULES[schedule]]


class JaxTrainer:
  """jaxshare's own train step (the function ``train.py`` jits) on device-resident synthetic batches."""

  def __init__(self, shape: dict, schedule: str, overrides: list[str]):
    import jax
    from jaxshare.config import load_config
    from jaxshare.train.loop import jit_train_step
    from jaxshare.train.state import init_state, setup_training
    from jaxshare.parallel import shard_batch
    from jaxshare.train.step import Objective

    self.jax = jax
    cfg = load_config(ROOT / "configs" / "base.yaml", jax_overrides(shape, schedule) + overrides)
    self.setup = setup_training(cfg)
    self.state = init_state(self.setup)
    self.step_fn = jit_train_step(self.setup, Objective(), None)
    self.batches = [shard_batch(self.setup.batch_sharding, one_document_rows(x, y)) for x, y in synthetic_batches(shape)]
    self.flops_per_token = self.setup.plan.train_flops_per_token(shape["seq_len"])  # the matched width's
    self.num_params = self.setup.num_params
    self.i = 0

  def step(self) -> None:
    with self.jax.set_mesh(self.setup.mesh):
      self.state, self.metrics = self.step_fn(self.state, self.batches[self.i % len(self.batches)], None)
    self.i += 1

  def sync(self) -> None:
    self.jax.block_until_ready(self.metrics)


def matmul_roofline(shape: dict, backend: str) -> float:
  """FLOP/s of fp32 matmuls of the model's own shapes (projections, MLP, LM head; forward and the two backward
  products), timed back to back in ``backend`` (``xla``: jitted JAX; ``torch``: eager PyTorch, the peers' GEMMs):
  what a step would reach if it were all matmul. Measured for both, it says whether XLA's matmuls are the faster
  ones on this machine."""
  n = shape["batch"] * shape["seq_len"]
  d, f, v = shape["d"], shape["mlp"], shape["vocab"]
  dims = [(d, 3 * d), (d, d), (d, 2 * f if shape["flavor"] == "llama" else f), (f, d), (d, v)]
  rng = np.random.default_rng(0)
  fns, flops = [], 0
  for k, m in dims:
    a, w, g = (rng.standard_normal(s, np.float32) for s in ((n, k), (k, m), (n, m)))
    fns += [(lambda a, w: a @ w, a, w), (lambda g, w: g @ w.T, g, w), (lambda a, g: a.T @ g, a, g)]
    flops += 3 * 2 * n * k * m
  if backend == "xla":
    import jax
    fns = [(lambda x, y, fn=jax.jit(fn): fn(x, y).block_until_ready(), jax.numpy.asarray(x), jax.numpy.asarray(y))
           for fn, x, y in fns]
  else:
    import torch
    fns = [(fn, torch.from_numpy(x), torch.from_numpy(y)) for fn, x, y in fns]
  for fn, x, y in fns:
    fn(x, y)
  best = float("inf")
  for _ in range(5):
    t = time.perf_counter()
    for fn, x, y in fns:
      fn(x, y)
    best = min(best, time.perf_counter() - t)
  return flops / best


def worker(kind: str, shape_name: str, schedule: str, overrides: list[str]) -> None:
  """Build, warm up, announce; then answer ``run K`` with the seconds K steps took, until ``quit``."""
  shape = SHAPES[shape_name]
  if kind == "jaxshare":
    trainer = JaxTrainer(shape, schedule, overrides)
    info = {"params": trainer.num_params, "flops_per_token": trainer.flops_per_token,
            "roofline_flops": matmul_roofline(shape, "xla")}
  elif kind == "jax_minimal":
    import jax_minimal
    trainer = jax_minimal.MinimalTrainer(shape, synthetic_batches(shape))
    info = {"params": trainer.num_params}
  else:
    import torch
    import torch_peers
    torch.set_num_threads(os.cpu_count())
    trainer = torch_peers.PeerTrainer(kind, shape, synthetic_batches(shape))
    trainer.sync = lambda: None  # every PyTorch step ends in loss.item()
    info = {"params": torch_peers.num_params(trainer.model), "roofline_flops": matmul_roofline(shape, "torch")}
  for _ in range(3):
    trainer.step()
  trainer.sync()
  print(json.dumps({"ready": True, **info}), flush=True)
  for line in sys.stdin:
    cmd = line.split()
    if cmd[0] == "quit":
      return
    t = time.perf_counter()
    for _ in range(int(cmd[1])):
      trainer.step()
    trainer.sync()
    print(json.dumps({"seconds": time.perf_counter() - t}), flush=True)


class Worker:
  def __init__(self, kind: str, shape: str, schedule: str, overrides: list[str] = (), tree: Path = ROOT):
    self.kind, self.schedule, self.overrides, self.tree = kind, schedule, list(overrides), tree
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tree), str(ROOT / "scripts")]))
    for o in self.overrides:  # env:NAME=VALUE sets the worker's environment (e.g. XLA_FLAGS)
      if o.startswith("env:"):
        name, value = o[4:].split("=", 1)
        env[name] = f"{env.get(name, '')} {value}".strip() if name == "XLA_FLAGS" else value
    config = [o for o in self.overrides if not o.startswith("env:")]
    self.proc = subprocess.Popen([sys.executable, __file__, "--worker", kind, "--shapes", shape, "--schedules",
                                  schedule, *[f"--override={o}" for o in config]], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
    self.info = self._read()

  def _read(self) -> dict:
    line = self.proc.stdout.readline()
    if not line:
      raise RuntimeError(f"benchmark worker {self.kind} died (see its stderr above)")
    return json.loads(line)

  def run(self, steps: int) -> float:
    self.proc.stdin.write(f"run {steps}\n")
    self.proc.stdin.flush()
    return self._read()["seconds"]

  def close(self) -> None:
    self.proc.stdin.write("quit\n")
    self.proc.stdin.flush()
    self.proc.wait()

  @property
  def label(self) -> str:
    if self.kind != "jaxshare":
      return self.kind
    tree = "" if self.tree == ROOT else f"@{self.tree}"
    return " ".join([f"jaxshare{tree} {self.schedule}", *self.overrides])


def race(workers: list, rounds: int, steps: int) -> dict[str, list[float]]:
  """Seconds each worker took for ``steps`` steps, per round. Round r starts at worker r (mod n): every contestant
  runs in every slot equally often, so what the previous contestant leaves behind (PyTorch's spinning OpenMP
  threads, a cold cache) does not fall on one of them only."""
  times: dict[str, list[float]] = {w.label: [] for w in workers}
  for r in range(rounds):
    for w in workers[r % len(workers):] + workers[:r % len(workers)]:
      times[w.label].append(w.run(steps))
  return times


def bench_shape(name: str, schedules: list[str], variants: list[list[str]], trees: list[Path], steps: int,
                rounds: int, minimal: bool, nanogpt: bool = False) -> list[dict]:
  shape = SHAPES[name]
  tokens = shape["batch"] * shape["seq_len"] * steps
  workers = [Worker("jaxshare", name, s, v, t) for t in trees for s in schedules for v in variants]
  # the calibration: the nanoGPT-style contestant, with nanoGPT's GPT-2 layer, against nanoGPT itself
  upstream = ("nanogpt_gpt2", "nanogpt_upstream") if nanogpt and "nanogpt" in shape["peers"] else ()
  workers += [Worker(p, name, "dense") for p in shape["peers"] + upstream + (("jax_minimal",) if minimal else ())]
  times = race(workers, rounds, steps)
  for w in workers:
    w.close()
  rows = []
  peer_labels = [w.label for w in workers if w.kind not in ("jaxshare", "nanogpt_gpt2")]
  for w in workers:
    tps = [tokens / t for t in times[w.label]]
    row = {"shape": name, "contestant": w.label, "params": w.info["params"], "tokens_per_sec": statistics.median(tps),
           "ms_per_step": 1e3 * statistics.median(times[w.label]) / steps}
    if w.kind in ("nanogpt", "nanogpt_gpt2") and upstream:
      per_round = [b / a for a, b in zip(times[w.label], times["nanogpt_upstream"])]
      row["vs_nanogpt_upstream"] = statistics.median(per_round)
      row["vs_nanogpt_upstream_range"] = (min(per_round), max(per_round))
    if w.kind == "jaxshare":
      # a sharing schedule is also measured against dense jaxshare of the same shape, round by round
      baseline = [] if w.label == "jaxshare dense" or "jaxshare dense" not in times else ["jaxshare dense"]
      for p in peer_labels + baseline:
        per_round = [b / a for a, b in zip(times[w.label], times[p])]
        row[f"vs_{p}"] = statistics.median(per_round)
        row[f"vs_{p}_range"] = (min(per_round), max(per_round))
      row["gflops"] = w.info["flops_per_token"] * row["tokens_per_sec"] / 1e9
    if "roofline_flops" in w.info:
      row["roofline_gflops"] = w.info["roofline_flops"] / 1e9
    rows.append(row)
  return rows


# train.py's cadence for the end-to-end row: a log line every 25 steps (the default experiment's) and a checkpoint
# every 50 (4x the default experiment's density: the row errs towards overhead), validation off.
E2E_STEPS = 100
E2E = ["train.log_every=25", "train.checkpoint_every=50", "train.keep_checkpoints=2", "train.eval_every=0",
       "train.warmup_steps=10", "train.progress_bar=false", f"train.steps={E2E_STEPS}"]


def train_py_tokens_per_sec(shape: dict, run_dir: Path) -> float:
  """``train.py``'s throughput at ``shape`` (dense, fp32, the corpus of ``configs/base.yaml``): tokens over the time
  of its log intervals after the first (which holds compilation); data, transfers, logging and checkpoint writes
  fall inside them."""
  cmd = [sys.executable, str(ROOT / "train.py"), "--no-eval", "--config", str(ROOT / "configs" / "base.yaml"),
         *jax_overrides(shape, "dense"), *E2E, f"train.run_dir={run_dir}"]
  proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
  if proc.returncode:
    raise RuntimeError(f"train.py exited {proc.returncode}:\n{proc.stderr[-3000:]}")
  records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
  records = [r for r in records if "tokens_per_sec" in r][1:]
  tokens = [shape["batch"] * shape["seq_len"] * 25 for _ in records]
  return sum(tokens) / sum(n / r["tokens_per_sec"] for n, r in zip(tokens, records))


def end_to_end(name: str, rounds: int) -> dict:
  """``train.py`` against the shape's first peer, alternating (each first in every other round); tokens/s of both
  (median over rounds) and their ratio (median, range)."""
  import tempfile

  shape = SHAPES[name]
  peer = Worker(shape["peers"][0], name, "dense")
  tokens = shape["batch"] * shape["seq_len"] * E2E_STEPS
  ours, theirs = [], []
  with tempfile.TemporaryDirectory() as tmp:
    for r in range(rounds):
      for which in (("train.py", "peer") if r % 2 == 0 else ("peer", "train.py")):
        if which == "peer":
          theirs.append(tokens / peer.run(E2E_STEPS))
        else:
          ours.append(train_py_tokens_per_sec(shape, Path(tmp) / f"round{r}"))
  peer.close()
  ratios = [a / b for a, b in zip(ours, theirs)]
  return {"shape": name, "contestant": "jaxshare train.py (end to end)", "tokens_per_sec": statistics.median(ours),
          "peer": peer.label, "peer_tokens_per_sec": statistics.median(theirs), "ratio": statistics.median(ratios),
          "ratio_range": (min(ratios), max(ratios))}


def report(rows: list[dict]) -> str:
  lines = ["| shape | contestant | params | tok/s | ms/step | speed vs peer (median, range over rounds) | "
           "model GFLOP/s (% of its matmul roofline) | matmul roofline GFLOP/s |",
           "|---|---|---|---|---|---|---|---|"]
  for r in rows:
    ratios = "; ".join(f"{r[k]:.2f}x vs {k[3:]} ({r[k + '_range'][0]:.2f}-{r[k + '_range'][1]:.2f})"
                       for k in r if k.startswith("vs_") and not k.endswith("_range"))
    flops = f"{r['gflops']:.0f} ({100 * r['gflops'] / r['roofline_gflops']:.0f}%)" if "gflops" in r else ""
    roofline = f"{r['roofline_gflops']:.0f}" if "roofline_gflops" in r else ""
    lines.append(f"| {r['shape']} | {r['contestant']} | {r['params']:,} | {r['tokens_per_sec']:,.0f} | "
                 f"{r['ms_per_step']:.0f} | {ratios} | {flops} | {roofline} |")
  return "\n".join(lines)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--shapes", default=",".join(SHAPES), help=f"comma-separated, from {list(SHAPES)}")
  parser.add_argument("--schedules", default="dense", help=f"jaxshare schedules, comma-separated, from "
                      f"{list(SCHEDULES)} (peers always run dense)")
  parser.add_argument("--steps", type=int, default=10, help="steps per contestant per round")
  parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds")
  parser.add_argument("--override", action="append", default=[],
                      help="config override for the jaxshare workers, e.g. model.scan_layers=false")
  parser.add_argument("--variant", action="append", default=[],
                      help="race an extra jaxshare variant: shell-quoted config overrides, or env:NAME=VALUE for the worker's "
                      "environment (env:XLA_FLAGS=... appends flags), e.g. \"'env:XLA_FLAGS=--a --b' model.x=1\"")
  parser.add_argument("--compare-tree", type=Path, action="append", default=[],
                      help="also race jaxshare from this checkout (e.g. a git worktree of an older commit)")
  parser.add_argument("--minimal", action="store_true",
                      help="also race jax_minimal.py, a bare pure-JAX Llama step (llama shapes): the compiler's floor")
  parser.add_argument("--nanogpt", type=Path, metavar="CHECKOUT",
                      help="a nanoGPT checkout: also race nanoGPT itself where the nanoGPT-style model races")
  parser.add_argument("--end-to-end", action="store_true",
                      help=f"also race train.py itself ({E2E_STEPS} steps of the real corpus, logging, checkpoints) "
                      "against each shape's first peer")
  parser.add_argument("--json", type=Path, help="also write the rows as JSON here")
  parser.add_argument("--results", type=Path, metavar="DIR", help="also write the printed tables with this command's "
                      "provenance to DIR/table.json (published by scripts/render_results.py)")
  parser.add_argument("--worker", help=argparse.SUPPRESS)
  args = parser.parse_args()
  shapes, schedules = args.shapes.split(","), args.schedules.split(",")
  for value, allowed, flag in ((shapes, SHAPES, "--shapes"), (schedules, SCHEDULES, "--schedules")):
    bad = [v for v in value if v not in allowed]
    if bad:
      parser.error(f"{flag} {bad} invalid: choose from {list(allowed)}")
  if args.worker:
    if args.worker in ("jaxshare", "jax_minimal"):  # XLA workers run with the allocator settings train.py uses
      try:
        from jaxshare.allocator import reexec_with_tuned_allocator
      except ImportError:  # a --compare-tree checkout from before them runs as it did then
        pass
      else:
        reexec_with_tuned_allocator()
    worker(args.worker, shapes[0], schedules[0], args.override)
    return
  if args.nanogpt:
    if not (args.nanogpt / "model.py").is_file():
      parser.error(f"--nanogpt {str(args.nanogpt)!r} invalid: not a nanoGPT checkout (no model.py)")
    os.environ["NANOGPT_DIR"] = str(args.nanogpt.resolve())  # the workers import its model.py
  print(f"{os.cpu_count()} CPU threads for every contestant; {args.rounds} rounds x {args.steps} steps each",
        flush=True)
  rows = []
  for name in shapes:
    variants = [args.override] + [args.override + shlex.split(v) for v in args.variant]
    rows += bench_shape(name, schedules, variants, [ROOT, *args.compare_tree], args.steps, args.rounds,
                        args.minimal and SHAPES[name]["flavor"] == "llama", args.nanogpt is not None)
    print(report([r for r in rows if r["shape"] == name]), flush=True)
  lines = report([r for r in rows if "ms_per_step" in r]).splitlines()
  if args.end_to_end:
    e2e = [end_to_end(name, args.rounds) for name in shapes]
    rows += e2e
    lines += ["", "| shape | train.py end to end, tok/s | peer, tok/s (same steps) | train.py vs peer (median, "
              "range) |", "|---|---|---|---|",
              *(f"| {r['shape']} | {r['tokens_per_sec']:,.0f} | {r['peer']} {r['peer_tokens_per_sec']:,.0f} | "
                f"{r['ratio']:.2f}x ({r['ratio_range'][0]:.2f}-{r['ratio_range'][1]:.2f}) |" for r in e2e)]
  print("\n" + "\n".join(lines))
  if args.json:
    args.json.write_text(json.dumps(rows, indent=1))
  if args.results:
    from jaxshare.sweep.provenance import publish_table

    publish_table(args.results.resolve(), lines, [[sys.executable, "scripts/bench_train.py", *sys.argv[1:]]],
                  f"tokens per second of the train step on {os.cpu_count()} CPU threads, medians over "
                  f"{args.rounds} interleaved rounds of {args.steps} steps (ratios: median and range over rounds)",
                  ROOT)


if __name__ == "__main__":
  main()
