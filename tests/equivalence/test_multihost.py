"""Scale-out on fake CPU devices: every mesh trains like one device for every schedule family, a checkpoint written
on one mesh resumes on another, and two processes joined by ``jax.distributed`` on localhost (CPU collectives)
train and resume exactly like one process (the two-process tests start two train.py processes each time, the
slowest in the suite: one test covers training like one process, resuming, and a checkpoint one process cannot read)."""

import json
import signal
import socket
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from conftest import REPO, SCHEDULE_FAMILIES, TINY, cpu_env, tiny_config
from jaxshare import parallel
from jaxshare.config import ConfigError, MeshConfig
from jaxshare.train.loop import jit_train_step, train
from jaxshare.parallel import shard_batch
from jaxshare.train.state import init_state, setup_training
from jaxshare.train.step import Objective

SCHEDULES = SCHEDULE_FAMILIES
MESHES = {"dp8": MeshConfig(data=8), "fsdp8": MeshConfig(fsdp=8), "fsdp4_tensor2": MeshConfig(fsdp=4, tensor=2),
          "data2_fsdp2_tensor2": MeshConfig(data=2, fsdp=2, tensor=2)}


def three_step_losses(cfg, mesh, batches):
  setup = setup_training(cfg, mesh)
  state = init_state(setup)
  step = jit_train_step(setup, Objective(), None)
  losses = []
  with jax.set_mesh(setup.mesh):
    for b in batches:
      state, m = step(state, shard_batch(setup.batch_sharding, b), None)
      losses.append(float(m["loss"]))
  return losses, setup


# Every schedule on the mesh that uses every axis, and every mesh on two schedules (one without and one with shared
# scores), instead of all against all: a sharding defect shows in one schedule's layers or in one mesh axis's rules,
# and each pair below still crosses every schedule family with every axis.
EVERY_AXIS = "data2_fsdp2_tensor2"
PAIRS = ([(schedule, EVERY_AXIS) for schedule in SCHEDULES]
         + [(schedule, mesh) for schedule in ("dense", "lisa_plus") for mesh in MESHES if mesh != EVERY_AXIS])


@pytest.fixture(scope="module")
def one_device_losses(batches):
  """The one-device reference losses per schedule, computed once for every mesh it is compared with."""
  cache = {}

  def losses(schedule):
    if schedule not in cache:
      cfg = tiny_config(*SCHEDULES[schedule])
      cache[schedule] = three_step_losses(cfg, parallel.make_mesh(MeshConfig(), jax.devices()[:1]), batches)[0]
    return cache[schedule]

  return losses


@pytest.mark.parametrize("schedule,mesh", PAIRS)
def test_mesh_trains_like_one_device(schedule, mesh, batches, one_device_losses):
  assert len(jax.devices()) == 8
  mesh_cfg = MESHES[mesh]
  losses, setup = three_step_losses(tiny_config(*SCHEDULES[schedule]), parallel.make_mesh(mesh_cfg), batches)
  np.testing.assert_allclose(losses, one_device_losses(schedule), rtol=1e-5, err_msg=f"{schedule} on {mesh}")
  if mesh_cfg.fsdp == 8:  # the parameters really are sharded
    specs = jax.tree.leaves(jax.tree.map(lambda s: s.spec, setup.param_shardings),
                            is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec))
    assert any("fsdp" in str(s) for s in specs)


def test_hybrid_mesh_needs_slices():
  with pytest.raises(ConfigError, match=r"mesh.dcn_\*: 2 slices requested, but the devices come from 1 slice"):
    parallel.make_mesh(MeshConfig(fsdp=-1, dcn_data=2))
  with pytest.raises(ConfigError, match="must fill all 4"):
    parallel.make_mesh(MeshConfig(fsdp=2, dcn_data=2), jax.devices()[:8])


def _losses(run_dir):
  return [json.loads(ln)["loss"] for ln in (run_dir / "metrics.jsonl").read_text().splitlines()]


# Constant learning rate after one warm-up step, so that a run stopped at step 3 and resumed with train.steps=6 follows
# the same curve as 6 straight steps; every step logged.
RESUMABLE = TINY + ["train.warmup_steps=1", "train.min_lr_ratio=1.0", "train.log_every=1", "train.eval_every=0",
                    "train.checkpoint_every=3", "schedule.kind=cla"]


@pytest.fixture(scope="module")
def one_process_curve(tmp_path_factory):
  """8 steps in this process on a data 2 x fsdp 4 mesh of the 8 devices."""
  from jaxshare.config import load_config

  run_dir = tmp_path_factory.mktemp("one") / "run"
  cfg = load_config(None, RESUMABLE + ["train.steps=8", f"train.run_dir={run_dir}", "mesh.data=2", "mesh.fsdp=4"])
  train(cfg)
  return _losses(run_dir)


def test_checkpoint_resumes_on_another_mesh(one_process_curve, tmp_path):
  from jaxshare.config import load_config

  run = [*RESUMABLE, f"train.run_dir={tmp_path / 'run'}"]
  train(load_config(None, run + ["train.steps=3", "mesh.fsdp=8"]))
  train(load_config(None, run + ["train.steps=6", "mesh.data=2", "mesh.tensor=4"]))
  np.testing.assert_allclose(_losses(tmp_path / "run"), one_process_curve[:6], rtol=1e-5)


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("localhost", 0))
    return s.getsockname()[1]


def _start_two_processes(run_dir, *overrides) -> list[subprocess.Popen]:
  """``train.py`` as two processes of 4 CPU devices each, joined through a coordinator on localhost."""
  env = cpu_env(4, xla_cache=False)
  port = _free_port()
  return [subprocess.Popen(
    [sys.executable, "-u", "train.py", "--no-eval", *RESUMABLE, f"train.run_dir={run_dir}", "mesh.fsdp=4",
     "mesh.dcn_data=2", f"distributed.coordinator_address=localhost:{port}", "distributed.num_processes=2",
     f"distributed.process_id={i}", *overrides], cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
    text=True) for i in range(2)]


def _two_processes(run_dir, *overrides, timeout=300, returncode=0):
  procs = _start_two_processes(run_dir, *overrides)
  outs = [p.communicate(timeout=timeout)[0] for p in procs]
  for p, out in zip(procs, outs):
    assert p.returncode == returncode, out[-3000:]
  return outs


@pytest.mark.slow
def test_sigterm_to_one_process_stops_both_at_the_same_step_with_a_checkpoint(tmp_path):
  """A preemption notice reaches one host of a pod first: JAX's preemption service agrees on a step, every process
  stops there and the checkpoint is written collectively (a local stop would leave the other in a collective)."""
  import re
  import threading

  run_dir = tmp_path / "run"
  procs = _start_two_processes(run_dir, "train.steps=100000", "train.checkpoint_every=100000")
  lines: list[str] = []
  reader = threading.Thread(target=lambda: lines.extend(procs[0].stdout), daemon=True)
  reader.start()
  deadline = time.time() + 240
  while not any(line.startswith("step      3/") for line in lines) and time.time() < deadline:
    time.sleep(0.05)
  procs[1].send_signal(signal.SIGTERM)  # the process that does not log
  other = procs[1].communicate(timeout=240)[0]
  procs[0].wait(timeout=240)
  reader.join(timeout=10)
  out = "".join(lines)
  assert procs[0].returncode == procs[1].returncode == 130, out[-3000:] + other[-3000:]
  stopped = int(re.search(r"interrupted by SIGTERM at step (\d+); checkpoint \1 saved", out).group(1))
  assert stopped >= 3 and {p.name for p in (run_dir / "checkpoints" / str(stopped) / "data").iterdir()} >= {
    "process_0-of-2.json", "process_1-of-2.json"}
  resumed = _two_processes(run_dir, f"train.steps={stopped + 2}")
  assert f"resumed at step {stopped}" in resumed[0]


@pytest.mark.slow
def test_two_processes_train_like_one_and_a_checkpoint_one_cannot_read_stops_the_run_with_what_to_do(
    one_process_curve, tmp_path):
  """Two processes train like one: only process 0 logs, each writes its own checkpoint shards, and the losses (also
  after resuming at step 3) are the one-process run's. With fsdp across the two processes each reads only the shards
  it wrote (ocdbt.process_<i>). A read that fails in one process fails inside orbax's collective restore, where the
  processes cannot agree to skip it: the run stops, the failing process at once (exit 2, saying which directory to
  move), the other when its collective loses the peer (or, at the latest, JAX's heartbeat timeout) instead of
  waiting forever; moved aside, the run resumes from the previous one on the same curve. (The sigterm test above runs
  the processes data-parallel instead: mesh.dcn_data=2.)"""
  run_dir = tmp_path / "run"
  across = ("mesh.fsdp=8", "mesh.dcn_data=1")
  first = _two_processes(run_dir, "train.steps=6", *across)
  assert "mesh {'data': 1, 'fsdp': 8, 'context': 1, 'tensor': 1} (8 cpu)" in first[0]
  assert "jaxshare |" not in first[1] and "training summary" not in first[1]  # only process 0 logs
  assert {"process_0-of-2.json", "process_1-of-2.json"} <= {p.name for p in (run_dir / "checkpoints" / "3" / "data").iterdir()}
  np.testing.assert_allclose(_losses(run_dir), one_process_curve[:6], rtol=1e-5)
  for f in (run_dir / "checkpoints" / "6" / "state" / "ocdbt.process_1" / "d").iterdir():
    f.write_bytes(f.read_bytes()[:100])
  procs = _start_two_processes(run_dir, "train.steps=8", *across)
  failing = procs[1].communicate(timeout=120)[0]
  assert procs[1].returncode == 2, failing[-3000:]
  assert f"move {run_dir / 'checkpoints' / '6'} to {run_dir / 'corrupt_checkpoints'}/ and re-run" in failing
  procs[0].communicate(timeout=240)
  assert procs[0].returncode != 0
  (run_dir / "corrupt_checkpoints").mkdir()
  (run_dir / "checkpoints" / "6").rename(run_dir / "corrupt_checkpoints" / "6")
  assert "resumed at step 3" in _two_processes(run_dir, "train.steps=8", *across)[0]
  losses = _losses(run_dir)
  print("\nstep | one process (8 devices) | two processes (4 + 4), resumed at 3")
  print("\n".join(f"{i + 1} | {a:.7f} | {b:.7f}" for i, (a, b) in enumerate(zip(one_process_curve, losses))))
  assert [json.loads(ln)["step"] for ln in (run_dir / "metrics.jsonl").read_text().splitlines()] == list(range(1, 9))
  np.testing.assert_allclose(losses, one_process_curve, rtol=1e-5)


_COMPILE_ON_MESHES = """
import sys
sys.path.insert(0, "tests")
import jax, jax.numpy as jnp
from conftest import tiny_config
from jaxshare import parallel
from jaxshare.config import MeshConfig
from jaxshare.data.batch import Batch
from jaxshare.train.loop import jit_train_step
from jaxshare.train.state import abstract_state, setup_training
from jaxshare.train.step import Objective
for mesh_cfg in (MeshConfig(fsdp=8), MeshConfig(data=2, fsdp=4), MeshConfig(fsdp=4, tensor=2)):
  for tie in ("false", "true"):
    setup = setup_training(tiny_config("schedule.kind=cla", f"model.tie_embeddings={tie}"), parallel.make_mesh(mesh_cfg))
    batch = Batch.spec(8, 32, setup.batch_sharding)
    with jax.set_mesh(setup.mesh):
      jit_train_step(setup, Objective(), None).trace(abstract_state(setup), batch, None).lower().compile()
print("compiled")
"""


def test_fsdp_train_step_never_replicates_a_tensor_to_reshard_it():
  """XLA's SPMD partitioner warns when it can only reshard by replicating a whole tensor on every device (the embedding
  lookup's cotangent did, from the batch-sharded activations to the fsdp-sharded table: B x T x D per device)."""
  env = cpu_env(8)
  proc = subprocess.run([sys.executable, "-c", _COMPILE_ON_MESHES], cwd=REPO, env=env, capture_output=True, text=True,
                        timeout=300)
  assert proc.returncode == 0 and "compiled" in proc.stdout, proc.stderr[-3000:]
  assert "Involuntary full rematerialization" not in proc.stderr, proc.stderr[-3000:]
