"""Checkpoint integrity: checksums catch changed bytes that orbax loads without complaint; a checkpoint that fails
verification or cannot be read is reported in one paragraph and the run falls back to the newest valid one, ending
on exactly the uninterrupted run's losses; unfinished writes never count and are cleaned."""

import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from conftest import REPO, STRAIGHT, TINY, read_metrics, tiny_config
from jaxshare import parallel
from jaxshare.config import MeshConfig, to_yaml
from jaxshare.store import integrity
from jaxshare.store.checkpoint import CheckpointError, Checkpointer, save_params
from jaxshare.train.loop import train
from jaxshare.store.runs import load_run


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16", "int32", "uint8", "bool"])
@pytest.mark.parametrize("shape", [(), (7,), (8, 5, 3)])
def test_checksums_see_every_changed_or_moved_word(dtype, shape):
  rng = np.random.default_rng(0)
  x = np.asarray(rng.integers(0, 2, shape) if dtype == "bool" else rng.normal(size=shape) * 50).astype(dtype)
  base = integrity.checksums({"x": jnp.asarray(x)})
  assert set(base) == {"['x']"} and len(base["['x']"]) == 16
  flat = x.reshape(-1)
  for i in range(flat.size):  # every single element changed
    y = flat.copy()
    y[i] = not y[i] if dtype == "bool" else y[i] + np.asarray(1, dtype)
    assert integrity.checksums({"x": jnp.asarray(y.reshape(shape))}) != base, (dtype, i)
  if flat.size > 1 and flat[0] != flat[1]:  # two elements swapped: the plain sum is the same, the weighted one not
    y = flat.copy()
    y[[0, 1]] = y[[1, 0]]
    assert integrity.checksums({"x": jnp.asarray(y.reshape(shape))}) != base


def test_checksums_do_not_depend_on_sharding():
  x = jax.random.normal(jax.random.key(0), (16, 24), jnp.bfloat16)
  mesh = parallel.make_mesh(MeshConfig(data=2, fsdp=4))
  sharded = jax.device_put(x, NamedSharding(mesh, P("data", "fsdp")))
  assert integrity.checksums([sharded]) == integrity.checksums([x])
  assert integrity.mismatches([sharded], integrity.checksums([x])) == []
  assert integrity.mismatches([sharded + 1], integrity.checksums([x])) == ["[0]"]


def _largest_chunk(step_dir):
  return max((step_dir / "state").rglob("ocdbt.process_0/d/*"), key=lambda f: f.stat().st_size)


def _flip_bytes(step_dir):
  """Bytes changed inside a compressed array chunk: orbax and TensorStore load it without complaint."""
  f = _largest_chunk(step_dir)
  data = bytearray(f.read_bytes())
  for i in range(1000, 1100):
    data[i] ^= 0x55
  f.write_bytes(bytes(data))


CORRUPTIONS = {
  "bytes flipped in a chunk": _flip_bytes,
  "chunk truncated": lambda d: _largest_chunk(d).write_bytes(_largest_chunk(d).read_bytes()[:1000]),
  "manifest deleted": lambda d: (d / "state" / "manifest.ocdbt").unlink(),
  "every state file garbage": lambda d: [f.write_bytes(b"garbage") for f in (d / "state").rglob("*") if f.is_file()],
  "metadata deleted": lambda d: shutil.rmtree(d / "meta"),
  "data iterator state garbage": lambda d: [f.write_text("{not json") for f in (d / "data").glob("*.json")],
}


@pytest.mark.parametrize("corruption", list(CORRUPTIONS))
def test_corrupt_latest_checkpoint_falls_back_and_continues_the_same_curve(straight_run, tmp_path, capsys,
                                                                           corruption):
  _, straight_dir, _ = straight_run
  run = tmp_path / "run"
  shutil.copytree(straight_dir, run)
  CORRUPTIONS[corruption](run / "checkpoints" / "20")
  summary = train(tiny_config(*STRAIGHT, f"train.run_dir={run}", "train.eval_every=0"))
  out = capsys.readouterr().out
  assert summary["step"] == 20
  warning = next(line for line in out.splitlines() if line.startswith("warning:"))
  assert f"checkpoint {run / 'checkpoints' / '20'}" in warning and "corrupt" in warning
  assert "Resuming from checkpoint 10" in warning and str(run / "corrupt_checkpoints" / "20") in warning
  assert "resumed at step 10" in out
  assert (run / "corrupt_checkpoints" / "20").is_dir()  # kept for inspection, out of the run's way
  assert sorted(int(p.name) for p in (run / "checkpoints").iterdir()) == [10, 20]  # 20 written again
  want = {r["step"]: r["loss"] for r in read_metrics(straight_dir)}
  got = {r["step"]: r["loss"] for r in read_metrics(run)}
  assert got == want  # bit-exact: steps 11-20 trained again from the verified checkpoint 10


def test_no_valid_checkpoint_is_an_error_and_nothing_moves(straight_run, tmp_path):
  _, straight_dir, _ = straight_run
  run = tmp_path / "run"
  shutil.copytree(straight_dir, run)
  for step in (10, 20):
    _flip_bytes(run / "checkpoints" / str(step))
  with pytest.raises(CheckpointError, match="No checkpoint in .* could be restored; nothing was moved") as e:
    train(tiny_config(*STRAIGHT, f"train.run_dir={run}", "train.eval_every=0"))
  assert "checkpoints/20 is corrupt" in str(e.value) and "checkpoints/10 is corrupt" in str(e.value)
  assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["10", "20"]
  assert not (run / "corrupt_checkpoints").exists()


def test_unfinished_writes_never_count_and_are_cleaned(straight_run, tmp_path, capsys):
  _, straight_dir, _ = straight_run
  run = tmp_path / "run"
  shutil.copytree(straight_dir, run)
  # What a kill during the step-30 write leaves: a temporary directory holding a partial checkpoint.
  shutil.copytree(run / "checkpoints" / "20", run / "checkpoints" / "30.orbax-checkpoint-tmp-1234")
  summary = train(tiny_config(*STRAIGHT, f"train.run_dir={run}", "train.steps=20", "train.eval_every=0"))
  assert summary["step"] == 20  # resumed at 20: the unfinished 30 was not taken for a checkpoint
  assert "removed 1 unfinished checkpoint write(s) an interrupted run left: 30.orbax-checkpoint-tmp-1234" in (
    capsys.readouterr().out)
  assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["10", "20"]


def _change_one_parameter(step_dir):
  """Rewrite ``state`` with one parameter element changed, through orbax itself: a well-formed checkpoint whose
  contents no longer match the checksums in its ``meta`` (what bytes changed inside a chunk amount to, aimed at a
  parameter so that a parameters-only load reads it)."""
  import orbax.checkpoint as ocp

  with ocp.StandardCheckpointer() as io:
    state = io.restore(step_dir / "state")
    state["params"]["embedding"] = np.asarray(state["params"]["embedding"]).copy()
    state["params"]["embedding"].flat[7] += 1.0
    io.save(step_dir.parent.parent / "rewritten", state)
  shutil.rmtree(step_dir / "state")
  shutil.copytree(step_dir.parent.parent / "rewritten", step_dir / "state")


def test_loading_a_corrupt_checkpoint_names_it(straight_run, tmp_path):
  _, straight_dir, _ = straight_run
  shutil.copytree(straight_dir, tmp_path / "run")
  _change_one_parameter(tmp_path / "run" / "checkpoints" / "20")
  with pytest.raises(CheckpointError, match=r"checkpoints/20 is corrupt: 1 of \d+ arrays differ from the checksums "
                     r"saved with them \(\['params'\]\['embedding'\]\)"):
    load_run(tmp_path / "run")  # what eval.py, the analysis and the converters load through
  assert load_run(tmp_path / "run" / "checkpoints" / "10").step == 10


def test_parameters_only_checkpoints_are_verified(tmp_path):
  params = {"w": np.arange(12, dtype=np.float32).reshape(3, 4)}
  save_params(tmp_path, 0, params, {"step": 0})
  ckpt = Checkpointer(tmp_path, 2)
  abstract = {"w": jax.ShapeDtypeStruct((3, 4), jnp.float32)}
  np.testing.assert_array_equal(ckpt.restore_params(0, abstract)["w"], params["w"])
  params["w"][1, 2] = 100.0
  save_params(tmp_path / "other", 0, params, {"step": 0})
  # the other checkpoint's arrays under this one's checksums: what a silently changed chunk amounts to
  shutil.rmtree(tmp_path / "0" / "state")
  shutil.copytree(tmp_path / "other" / "0" / "state", tmp_path / "0" / "state")
  with pytest.raises(CheckpointError, match=r"1 of 1 arrays differ from the checksums saved with them \(\['params'\]"):
    ckpt.restore_params(0, abstract)
  ckpt.close()


_ABANDONED_READS = """
import asyncio, gc, logging, sys
from jaxshare.store import checkpoint
logging.basicConfig()
checkpoint._mute_library_noise()
src = "async def read():\\n  raise ValueError('OUT_OF_RANGE: spec dump')\\n"
for filename in ("/site-packages/orbax/checkpoint/serialization.py", "/home/user/mine.py"):
  ns = {}
  exec(compile(src, filename, "exec"), ns)
  loop = asyncio.new_event_loop()
  async def abandon(wrap):  # a failed read nobody awaits, as orbax leaves them when one shard fails
    fut = wrap(ns["read"]())
    await asyncio.sleep(0.01)
  for wrap in (asyncio.ensure_future, lambda c: asyncio.gather(c)):
    loop.run_until_complete(abandon(wrap))
    gc.collect()
  loop.close()
  print("--", filename, file=sys.stderr, flush=True)
"""


def test_abandoned_orbax_reads_are_muted_and_others_are_not():
  """Orbax's abandoned reads are reported by asyncio as "Task exception was never retrieved" and, for a gather, as
  "_GatheringFuture exception was never retrieved"; only the first was muted, and eval.py's one-line error came
  with 75 lines of spec dumps whenever the gather was collected before exit. Failures from other code still show."""
  proc = subprocess.run([sys.executable, "-c", _ABANDONED_READS], capture_output=True, text=True, cwd=REPO,
                        timeout=120)
  assert proc.returncode == 0, proc.stderr
  orbax_part, _, other_part = proc.stderr.partition("-- /site-packages/orbax/")
  assert "never retrieved" not in orbax_part and "OUT_OF_RANGE" not in orbax_part, proc.stderr
  assert other_part.count("Task exception was never retrieved") == 1, proc.stderr
  assert other_part.count("_GatheringFuture exception was never retrieved") == 1, proc.stderr


_UNAWAITED_READS = """
import gc, sys, warnings
from jaxshare.store import checkpoint
checkpoint._mute_library_noise()
warnings.simplefilter("always")
src = "async def read():\\n  return 1\\n"
for filename in ("/site-packages/orbax/checkpoint/serialization.py", "/home/user/mine.py"):
  ns = {}
  exec(compile(src, filename, "exec"), ns)
  coro = ns["read"]()  # a read orbax created and then abandoned, unscheduled, when another failed
  del coro
  gc.collect()
  print("--", filename, file=sys.stderr, flush=True)
"""


def test_unawaited_orbax_reads_are_muted_and_others_are_not():
  """A read that orbax created but never started when another one failed is reported, when it is collected, as
  "coroutine ... was never awaited" (a RuntimeWarning: seen once in `make test`, a second line under train.py's
  one-line error). Orbax's are muted; other code's still show."""
  proc = subprocess.run([sys.executable, "-c", _UNAWAITED_READS], capture_output=True, text=True, cwd=REPO,
                        timeout=120)
  assert proc.returncode == 0, proc.stderr
  orbax_part, _, other_part = proc.stderr.partition("-- /site-packages/orbax/")
  assert "never awaited" not in orbax_part, proc.stderr
  assert other_part.count("coroutine 'read' was never awaited") == 1, proc.stderr


def test_cli_reports_an_unreadable_run_in_one_paragraph(straight_run, tmp_path):
  """TensorStore's failures came with 25-938 lines of spec dumps; now one paragraph per checkpoint, exit 2."""
  _, straight_dir, _ = straight_run
  run = tmp_path / "run"
  shutil.copytree(straight_dir, run)
  for step in (10, 20):
    f = _largest_chunk(run / "checkpoints" / str(step))
    f.write_bytes(f.read_bytes()[:1000])
  proc = subprocess.run([sys.executable, str(REPO / "train.py"), *TINY, *STRAIGHT,
                         f"train.run_dir={run}"], capture_output=True, text=True, cwd=REPO, timeout=300)
  assert proc.returncode == 2, proc.stderr
  lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
  assert len(lines) == 1 and lines[0].startswith("error: checkpoint "), proc.stderr
  assert "OUT_OF_RANGE" in lines[0] and "tensorstore_spec" not in lines[0] and len(lines[0]) < 1500



def test_eval_cli_reports_an_unreadable_checkpoint_in_one_line(straight_run, tmp_path):
  """The parameters-only read left its abandoned reads to be reported at exit (TensorStore spec dumps after the
  error); now one line, exit 2."""
  _, straight_dir, _ = straight_run
  shutil.copytree(straight_dir, tmp_path / "run")
  for f in (tmp_path / "run" / "checkpoints" / "20" / "state").rglob("ocdbt.process_0/d/*"):
    f.write_bytes(f.read_bytes()[:100])
  proc = subprocess.run([sys.executable, str(REPO / "eval.py"), str(tmp_path / "run")], capture_output=True,
                        text=True, cwd=REPO, timeout=300)
  assert proc.returncode == 2, proc.stderr
  lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
  assert len(lines) == 1 and lines[0].startswith("error: checkpoint ") and "could not be read" in lines[0], proc.stderr


def test_a_checkpoint_written_before_the_stacks_were_renamed_resumes_and_loads(tmp_path):
  """Checkpoints of jaxshare before issue 47 store the stacks under "segments" (in the parameters and in the
  optimizer's moments): a run resumes from one, verified against its own checksums, and load_run reads its weights,
  both under today's names and with the same values."""
  from jaxshare.store.checkpoint import rename_keys
  from jaxshare.store.runs import write_run_files
  from jaxshare.train.state import abstract_state, init_state, setup_training

  cfg = tiny_config("schedule.kind=cla", f"train.run_dir={tmp_path}")
  setup = setup_training(cfg)
  state = init_state(setup)
  old = rename_keys(state.as_dict(), {"stacks": "segments"})
  assert "segments" in old["params"] and "segments" in old["opt_state"][1][0].mu  # what an older jaxshare saved
  write_run_files(tmp_path, to_yaml(cfg))
  ckpt = Checkpointer(tmp_path / "checkpoints", 2)
  ckpt.save(3, old, None, {"step": 3})
  ckpt.wait()
  restored, _ = ckpt.restore(3, abstract_state(setup).as_dict(), None)
  jax.tree.map(np.testing.assert_array_equal, jax.device_get(restored), jax.device_get(state.as_dict()))
  run = load_run(tmp_path)
  assert "stacks" in run.params and "segments" not in run.params
  jax.tree.map(np.testing.assert_array_equal, jax.device_get(run.params), jax.device_get(state.params))
  ckpt.close()


def test_a_tensorstore_read_error_left_in_an_abandoned_future_is_kept_off_the_console():
  """A corrupt checkpoint's failed reads finish asyncio futures that nobody retrieves, and asyncio logs each when it
  is collected: from orbax's frames (dropped before), or, for TensorStore's own futures, with no Python frame at all
  (seen in `make test`: test_cli_reports_an_unreadable_run_in_one_paragraph printed a dozen such records). Both are
  dropped; a frameless error that is not TensorStore's status still shows."""
  import logging

  from jaxshare.store.checkpoint import _mute_library_noise

  _mute_library_noise()
  log = logging.getLogger("asyncio")

  def abandoned(error):
    return log.makeRecord("asyncio", logging.ERROR, __file__, 1, "Future exception was never retrieved\nfuture: %s",
                          ("<Future finished>",), (type(error), error, None))

  assert not log.filter(abandoned(ValueError('OUT_OF_RANGE: Error reading "opt_state" in OCDBT database at local '
                                             'file "/run/checkpoints/20/state/"')))
  assert log.filter(abandoned(ValueError("a bug elsewhere")))
