"""Determinism: the same config and seed give bit-identical runs; a scanned model trains bit-identically to the same
model unrolled; the data a global batch holds does not depend on how many devices or processes read it."""

import dataclasses
import shutil

import jax
import numpy as np
import pytest

from conftest import read_metrics, tiny_config
from jaxshare import parallel
from jaxshare.config import MeshConfig
from jaxshare.config.catalogue import schedule_matrix
from jaxshare.data import Datasets
from jaxshare.train.loop import jit_train_step, train
from jaxshare.train.state import init_state, setup_training
from jaxshare.store.runs import load_run
from jaxshare.parallel import local_batch_rows, shard_batch
from jaxshare.train.step import Objective

_TIMING = ("tokens_per_sec", "step_time", "mfu")  # wall-clock figures, the only fields allowed to differ


def test_same_config_and_seed_give_bit_identical_runs(straight_run, tmp_path):
  cfg, straight_dir, _ = straight_run
  train(dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, run_dir=str(tmp_path))))
  strip = lambda records: [{k: v for k, v in r.items() if k not in _TIMING} for r in records]  # noqa: E731
  assert strip(read_metrics(tmp_path)) == strip(read_metrics(straight_dir))  # loss, val_loss, grad_norm, lr
  run = load_run(tmp_path)
  a = run.params
  run = load_run(straight_dir)
  b = run.params
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


SCHEDULES = schedule_matrix("determinism")


def _train_steps(cfg, batches):
  setup = setup_training(cfg, parallel.make_mesh(MeshConfig(), jax.devices()[:1]))
  state, step = init_state(setup), jit_train_step(setup, Objective(), None)
  losses = []
  with jax.set_mesh(setup.mesh):
    for b in batches:
      state, metrics = step(state, shard_batch(setup.batch_sharding, b), None)
      losses.append(float(metrics["loss"]))
  return losses, jax.device_get(state.params)


@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_scanned_and_unrolled_layers_train_bit_identically(schedule, batches):
  scanned, p_scan = _train_steps(tiny_config(*SCHEDULES[schedule]), batches)
  unrolled, p_unrolled = _train_steps(tiny_config(*SCHEDULES[schedule], "model.scan_layers=false"), batches)
  assert scanned == unrolled
  # both keep layers stacked [superblocks, layers of a run, ...]: one tree layout, compared leaf by leaf
  assert jax.tree.structure(p_scan) == jax.tree.structure(p_unrolled)
  for x, y in zip(jax.tree.leaves(p_scan), jax.tree.leaves(p_unrolled)):
    np.testing.assert_array_equal(x, y)


def test_data_order_does_not_depend_on_process_count():
  cfg = tiny_config()
  B = cfg.train.batch_size
  whole = Datasets(cfg.data, B, process_index=0, process_count=1).train_iter()
  reference = [next(whole) for _ in range(3)]
  for count in (2, 4, 8):
    its = [Datasets(cfg.data, B, process_index=p, process_count=count).train_iter() for p in range(count)]
    for ref in reference:
      parts = [next(it) for it in its]
      for key in ("inputs", "targets", "positions", "segment_ids", "loss_mask"):
        np.testing.assert_array_equal(np.concatenate([getattr(p, key) for p in parts]), getattr(ref, key),
                                      err_msg=f"{count} processes")
  other = next(Datasets(dataclasses.replace(cfg.data, shuffle_seed=1), B).train_iter())
  assert not np.array_equal(other.inputs, reference[0].inputs)  # the order really comes from the seed


@pytest.mark.parametrize("mesh_cfg", [MeshConfig(), MeshConfig(data=2), MeshConfig(fsdp=8),
                                      MeshConfig(data=2, fsdp=2, tensor=2)], ids=str)
def test_every_device_count_feeds_the_same_global_batch(mesh_cfg, batches):
  setup = setup_training(tiny_config(), parallel.make_mesh(mesh_cfg, jax.devices()[:mesh_cfg.data * mesh_cfg.fsdp
                                                                            * mesh_cfg.tensor]))
  assert local_batch_rows(setup.batch_sharding, 8) == slice(0, 8)  # one process reads every row, whatever the mesh
  placed = jax.device_get(shard_batch(setup.batch_sharding, batches[0]))
  jax.tree.map(np.testing.assert_array_equal, placed, batches[0])


def test_a_copied_run_directory_resumes_identically(straight_run, tmp_path):
  """A run's state is all in its directory: a copy resumed elsewhere continues the same curve as the original."""
  cfg, straight_dir, _ = straight_run
  for name in ("a", "b"):
    shutil.copytree(straight_dir, tmp_path / name)
    train(dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, run_dir=str(tmp_path / name), steps=25)))
  assert [r["loss"] for r in read_metrics(tmp_path / "a")] == [r["loss"] for r in read_metrics(tmp_path / "b")]
