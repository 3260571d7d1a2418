"""Test setup: 8 fake CPU devices (set before jax is imported), fast compiles, and small shared configs."""

import os

# The suite's programs are tiny and each runs a few times: compiling them is most of its time. Every test process,
# and every train.py it starts, compiles without XLA's backend optimisations (jax_disable_most_optimizations) and with
# XLA:CPU's older fusion emitters (whose compiles are ~2x faster than the MLIR ones at these sizes) on one codegen
# thread: a tiny train step compiles in ~0.9 s instead of ~6 s. The programs mean the same; `make train`, the
# benchmarks and the ahead-of-time memory reports (OPTIMIZED_ENV) compile as production does.
#
# XLA's persistent compilation cache is shared by every test process and the train.py children they start, and kept
# between runs (XLA_CACHE below): a program compiled once by any earlier test or run is read back instead of compiled
# again. Its key is the program's HLO (debug locations stripped), the compile options, the XLA flags and the jax/jaxlib
# versions, so an entry can only answer for the identical program: a changed program misses. The cache runs without
# jax's size limit: with one, every write lists and stats the whole directory under a file lock (the suite writes
# ~10,000 entries, and that scan doubled its wall time); the directory is emptied instead when a session starts above
# XLA_CACHE_MAX_BYTES. xla_cache_site/sitecustomize.py, first on every test process's PYTHONPATH, changes two things:
# - each write is whole (a temporary file renamed into place): without the size limit jax writes an entry in place,
#   and two processes compiling one program at once would write one file together;
# - executables of more than one device are compiled afresh, never cached. With them read back, an in-process run on
#   the 8-device mesh aborted in XLA:CPU's collective rendezvous (its 40 s timeout; the device threads of one RunId
#   at different collectives: 6 of 8 at a gradient all-reduce, one per fsdp group at an all-gather), with a warm cache
#   2 of 2 times (later 0 of 1: it depends on timing) in `pytest -p no:xdist tests/equivalence/test_determinism.py
#   tests/equivalence/test_multihost.py -k "not two_processes and not sigterm and not cannot_read"`, and in 1 of 6
#   full runs. Single-device executables, most of the suite's, never showed it. Not root-caused; jax-ml/jax#38004
#   reports crashes reading cached executables of device subsets.
# Production-compiled children (OPTIMIZED_ENV) never use the cache, nor do the processes of a multi-process run
# (cpu_env's xla_cache=False): with it, a SIGTERM to one of two processes under the suite's load left both running past
# the test's limit. Every test process runs with Python's faulthandler, so a crash inside XLA prints its stack.
FAST_COMPILE_FLAGS = ("--xla_cpu_use_fusion_emitters=false --xla_cpu_use_xnnpack=false "
                      "--xla_cpu_parallel_codegen_split_count=1")


# The suite's directory for XLA's persistent cache: JAXSHARE_TEST_XLA_CACHE=DIR, or =off; by default
# $XDG_CACHE_HOME/jaxshare-tests/xla (~/.cache/...), so that later runs on the machine start warm.
_XLA_CACHE_SETTING = os.environ.get("JAXSHARE_TEST_XLA_CACHE", "")
XLA_CACHE = "" if _XLA_CACHE_SETTING == "off" else _XLA_CACHE_SETTING or os.path.join(
  os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "jaxshare-tests", "xla")
_SITE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "xla_cache_site")
XLA_CACHE_MAX_BYTES = 2 << 30
_XLA_CACHE_ENV = {"JAX_COMPILATION_CACHE_DIR": XLA_CACHE, "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
                  "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0"} if XLA_CACHE else {}


def cpu_env(devices: int, optimized: bool = False, xla_cache: bool = True) -> dict[str, str]:
  """The environment of a child JAX process on ``devices`` fake CPU devices: compiling fast as the tests do (sharing
  the suite's persistent compilation cache unless ``xla_cache`` is False), or as production does (``optimized``, no
  cache). Processes of one multi-process run go without the cache: with it, a SIGTERM to one of two processes under
  load left both running past the test's 4-minute limit (twice in two tries; never without it)."""
  flags = f"--xla_force_host_platform_device_count={devices}"
  env = {k: v for k, v in os.environ.items() if k not in _XLA_CACHE_ENV}
  if optimized:
    return {**env, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": flags, "JAX_DISABLE_MOST_OPTIMIZATIONS": "0"}
  return {**env, **(_XLA_CACHE_ENV if xla_cache else {}), "JAX_PLATFORMS": "cpu",
          "XLA_FLAGS": f"{FAST_COMPILE_FLAGS} {flags}", "JAX_DISABLE_MOST_OPTIMIZATIONS": "1"}


def _prune_xla_cache() -> None:
  """Empty the suite's XLA cache when it has grown above XLA_CACHE_MAX_BYTES (once per session: the xdist
  controller, before any worker starts)."""
  if os.environ.get("PYTEST_XDIST_WORKER") or not XLA_CACHE or not os.path.isdir(XLA_CACHE):
    return
  entries = os.scandir(XLA_CACHE)
  if sum(e.stat().st_size for e in entries if e.is_file()) > XLA_CACHE_MAX_BYTES:
    __import__("shutil").rmtree(XLA_CACHE, ignore_errors=True)


_prune_xla_cache()
os.environ.update(cpu_env(8), PYTHONFAULTHANDLER="1",
                  PYTHONPATH=os.pathsep.join(p for p in (_SITE, os.environ.get("PYTHONPATH", "")) if p))
import xla_cache_site.sitecustomize  # noqa: E402,F401  (this process, started without that PYTHONPATH)
# What jaxshare caches (tokenizer backends) goes to a directory of this run, not the user's ~/.cache.
os.environ["JAXSHARE_CACHE_DIR"] = __import__("tempfile").mkdtemp(prefix="jaxshare-test-cache-")
import functools  # noqa: E402
import importlib.util  # noqa: E402
import json  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402
import pytest  # noqa: E402

from jaxshare.config import load_config  # noqa: E402
from jaxshare.config.catalogue import schedule_matrix  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
# The environment of a child process that compiles as production does.
OPTIMIZED_ENV = cpu_env(8, optimized=True)

CORPUS = REPO.parent / "shared" / "data" / "tinyshakespeare.txt"

# The ahead-of-time compile tests need libtpu (TPU topologies) or jax's CUDA plugin (GPU clusters); `make test`
# installs both beside the venv.
needs_libtpu = pytest.mark.skipif(
  not (REPO / ".libtpu" / "libtpu").is_dir() and importlib.util.find_spec("libtpu") is None,
  reason="libtpu is not installed (make .libtpu/.installed)")
needs_cuda_plugin = pytest.mark.skipif(not (REPO / ".jaxcuda" / "jax_plugins").is_dir(),
                                       reason="jax's CUDA plugin is not installed (make .jaxcuda/.installed)")
needs_cudnn = pytest.mark.skipif(not (REPO / ".jaxcuda" / "nvidia" / "cudnn").is_dir(),
                                 reason="NVIDIA's cuDNN is not installed beside the plugin (make .jaxcuda/.cudnn)")


def pytest_collection_modifyitems(items):
  """Tests marked ``longest`` first (stable otherwise): xdist hands tests out in this order, and one that runs for
  minutes, started last, would leave a single process running it while the others idle."""
  items.sort(key=lambda item: item.get_closest_marker("longest") is None)


# A very small model (fast to compile) on the real corpus, as command-line overrides.
TINY = ["model.num_layers=4", "model.d_model=32", "model.num_heads=4", "model.mlp_dim=64",
        "data.seq_len=32", "train.batch_size=8", "train.steps=20", "train.warmup_steps=2",
        "train.log_every=5", "train.eval_every=10", "train.eval_batches=2", "train.checkpoint_every=10",
        "train.progress_bar=false", "train.lr=3e-3",
        # a configured MFU peak: measuring the host's roofline costs each train.py process ~0.5 s
        # (tests/unit/train/test_metrics.py and test_train.py's real run measure it)
        "train.peak_tflops=0.1"]


@functools.cache
def tiny_config(*overrides: str):
  """A very small model (fast to compile) on the real corpus. Memoised: a config is a frozen value, and composing
  one through OmegaConf took ~5% of the model tests' time, most of it for configs an earlier case had built."""
  return load_config(None, TINY + list(overrides))


@pytest.fixture(scope="module")
def batches():
  """Three training batches of the tiny config from the corpus."""
  from jaxshare.data import Datasets
  cfg = tiny_config()
  it = Datasets(cfg.data, cfg.train.batch_size).train_iter()
  return [next(it) for _ in range(3)]


@pytest.fixture
def corpus() -> Path:
  if not CORPUS.is_file():
    pytest.fail(f"the shared corpus {CORPUS} is missing")
  return CORPUS


def write_bpe_tokenizer(directory: Path, text: str, vocab_size: int = 300) -> Path:
  """A byte-level BPE tokenizer trained on ``text`` (EOS ``<eos>`` = id 0), saved as a Hugging Face directory."""
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
  from transformers import PreTrainedTokenizerFast

  tok = Tokenizer(models.BPE(unk_token="<unk>"))
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  tok.train_from_iterator([text], trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<eos>", "<unk>"]))
  PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", unk_token="<unk>").save_pretrained(directory)
  return directory


TFDS_TEXT_DOCS = [f"document number {i} " * 3 for i in range(50)]


@functools.cache
def _tfds_text_builder():
  """The builder class of ``tiny_text`` (defined once: TFDS registers builder classes by name)."""
  tfds = pytest.importorskip("tensorflow_datasets")
  pytest.importorskip("array_record")

  class TinyText(tfds.core.GeneratorBasedBuilder):
    VERSION = tfds.core.Version("1.0.0")

    def _info(self):
      return tfds.core.DatasetInfo(builder=self, features=tfds.features.FeaturesDict({"text": tfds.features.Text()}))

    def _split_generators(self, dl_manager):
      return {"train": self._generate_examples()}

    def _generate_examples(self):
      yield from enumerate({"text": d} for d in TFDS_TEXT_DOCS)

  return TinyText


def write_tfds_text_dataset(data_dir: Path) -> None:
  """TFDS dataset ``tiny_text`` (split ``train``: the 50 documents of TFDS_TEXT_DOCS in feature ``text``, in TFDS's
  order, ArrayRecord) in ``data_dir``."""
  _tfds_text_builder()(data_dir=str(data_dir), file_format="array_record").download_and_prepare()


def write_multiple_choice_task(directory: Path, name: str, docs: list[dict]) -> None:
  """An lm-evaluation-harness multiple-choice task ``name`` in ``directory`` (YAML + JSONL; the hub is unreachable):
  ``docs`` of ``{"context", "choices", "label"}``, each context followed by a newline."""
  with open(directory / f"{name}.jsonl", "w") as f:
    f.writelines(json.dumps(doc) + "\n" for doc in docs)
  (directory / f"{name}.yaml").write_text(f"""task: {name}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {directory / f'{name}.jsonl'}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{context}}}}\\n"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{label}}}}"
metric_list:
  - metric: acc
""")


@pytest.fixture
def keep_signal_handlers():
  """train.py's main installs SIGINT/SIGTERM handlers for its run; give the test process its own back."""
  import signal

  saved = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
  yield
  for s, handler in saved.items():
    signal.signal(s, handler)


def read_metrics(run_dir) -> list[dict]:
  """The records of a run's ``metrics.jsonl``."""
  return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


# One small schedule of each family, as overrides on tiny_config (multi-device and determinism tests run each).
SCHEDULE_FAMILIES = schedule_matrix("families")

STRAIGHT = ("schedule.kind=mlkv", "schedule.kv_layers=2")  # the straight run's schedule, as overrides


@pytest.fixture(scope="session")
def straight_run(tmp_path_factory):
  """``(config, run_dir, summary)`` of an uninterrupted 20-step tiny MLKV run (checkpoints at 10 and 20): what
  resumed, interrupted and corrupted runs are compared with. Tests copy it before changing anything."""
  from jaxshare.train.loop import train

  run_dir = tmp_path_factory.mktemp("straight")
  cfg = tiny_config(*STRAIGHT, f"train.run_dir={run_dir}")
  return cfg, run_dir, train(cfg)


@pytest.fixture(scope="session")
def gcs(tmp_path_factory):
  """A real GCS server (tests/support/gcs.py) for this test process, with bucket ``runs``; this process's clients
  point at it (for in-process reads and writes), and ``gcs.env()`` points a child's. A test that stops it starts it
  again before it ends."""
  from support.gcs import GCSServer, restore_environment, set_environment

  server = GCSServer(tmp_path_factory.mktemp("gcs"))
  server.start()
  server.make_bucket("runs")
  previous = set_environment(server)
  yield server
  restore_environment(previous)
  server.stop()
