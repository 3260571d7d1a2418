"""The ahead-of-time fit check (``train.py --compile-only``, jaxshare/aot/): accelerator types name topologies, the
traced FLOP count follows scans and shard_map, and, with libtpu, a small model's train step compiles for a TPU
topology (and two slices of it) and fits while a too-large batch is refused with advice and exit code 3. The libtpu
cases run train.py in a child process: libtpu is initialised there, not in the test workers."""

import importlib.util
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec as P

from conftest import OPTIMIZED_ENV, REPO
from jaxshare.config import ConfigError
from jaxshare.aot.topology import hbm_bytes, topology_name

needs_libtpu = pytest.mark.skipif(
  not (REPO / ".libtpu" / "libtpu").is_dir() and importlib.util.find_spec("libtpu") is None,
  reason="libtpu is not installed (make .libtpu/.installed)")

SMALL = ["model.num_layers=2", "model.d_model=128", "model.num_heads=4", "model.mlp_dim=256", "data.seq_len=256",
         "mesh.fsdp=-1"]


def compile_only(*args: str) -> subprocess.CompletedProcess:
  return subprocess.run([sys.executable, "train.py", "--compile-only", *args], cwd=REPO, capture_output=True,
                        text=True, timeout=600, env=OPTIMIZED_ENV)


def gib(text: str) -> float:
  value, unit = text.split()
  return float(value) * (1 if unit == "GiB" else 2 ** -10)


@pytest.mark.parametrize("name,topology", [
  ("v5e-256", "v5e:16x16"), ("v5e-8", "v5e:2x4"), ("v5litepod-16", "v5e:4x4"), ("v6e-64", "v6e:8x8"),
  ("v5p-8", "v5p:2x2x1"), ("v5p-128", "v5p:4x4x4"), ("v5p-256", "v5p:4x4x8"), ("v4-32", "v4:2x2x4"),
  ("v5e:2x2", "v5e:2x2")])
def test_accelerator_types_name_topologies(name, topology):
  assert topology_name(name) == topology


@pytest.mark.parametrize("name,message", [
  ("v5p-6", "v5p-N needs N = 2 x a power of two"), ("v5e-24", "v5e-N needs N = a power of two"),
  ("v3-8", "name a TPU topology"), ("tpu", "name a TPU topology")])
def test_bad_accelerator_types_are_refused_by_name(name, message):
  with pytest.raises(ConfigError, match=re.escape(message)):
    topology_name(name)


def test_hbm_by_device_kind():
  assert [hbm_bytes(k) / 2 ** 30 for k in ("TPU v5 lite", "TPU v5", "TPU v6 lite", "TPU v4")] == [16, 95, 32, 32]
  assert hbm_bytes("cpu") is None


def test_matmul_flops_follow_scans_and_shard_map():
  from jaxshare.aot.compile import compiler_oom
  from jaxshare.aot.report import matmul_flops

  def layers(x, w):  # 3 scanned [8, 16] x [16, 16] matmuls
    return jax.lax.scan(lambda h, wi: (h @ wi, None), x, w)[0]

  x, w = jnp.ones((8, 16)), jnp.ones((3, 16, 16))
  assert matmul_flops(jax.make_jaxpr(layers)(x, w)) == (3 * 2 * 8 * 16 * 16, 0)
  mesh = Mesh(np.array(jax.devices()[:4]), ("x",))
  sharded = jax.shard_map(lambda a, b: a @ b, mesh=mesh, in_specs=(P("x"), P()), out_specs=P("x"))
  assert matmul_flops(jax.make_jaxpr(sharded)(x, w[0]))[0] == 2 * 8 * 16 * 16  # per-shard shapes x 4 shards
  mesh2 = Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("x", "y"))  # manual over x only: 2 shards
  partly = jax.shard_map(lambda a, b: a @ b, mesh=mesh2, in_specs=(P("x"), P()), out_specs=P("x"), axis_names={"x"})
  assert matmul_flops(jax.make_jaxpr(partly)(x, w[0]))[0] == 2 * 8 * 16 * 16
  assert compiler_oom("... HLO temporaries (21.42G) exceeds available HBM (15.75G).") == (
    round(21.42 * 2 ** 30), round(15.75 * 2 ** 30))


@needs_libtpu
def test_small_model_fits_on_a_tpu_topology():
  proc = compile_only("--topology=v5e-4", *SMALL, "train.batch_size=8")
  assert proc.returncode == 0, proc.stderr[-3000:]
  out = proc.stdout
  assert "compiled for v5e:2x2 (v5e-4): 4 x TPU v5 lite" in out and "fits: yes" in out, out
  hbm, usable = re.search(r"HBM per chip: ([\d.]+ [GM]iB) \(compiler's peak\) of ([\d.]+ GiB) usable \(the "
                          r"compiler's limit; 16 GiB HBM\)", out).groups()
  state = re.search(r"train state per chip: ([\d.]+ [GM]iB)", out).group(1)
  # ~0.4M parameters x 12 bytes (f32 weights, AdamW moments) over 4 chips; activations of 2 x 256 tokens per chip
  assert 0.5 < gib(state) * 2 ** 10 < 2 and gib(state) < gib(hbm) < 0.5 and gib(usable) == 15.75
  model, executed = (float(v) for v in re.search(r"model ([\d.e+]+), executed ([\d.e+]+)", out).groups())
  assert 0 < model <= executed


@needs_libtpu
def test_two_slices_compile_with_data_parallel_across_them():
  proc = compile_only("--topology=v5e:2x2", "--num-slices=2", *SMALL, "train.batch_size=8")
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert "8 x TPU v5 lite, 2 slices" in proc.stdout and "mesh data=2 fsdp=4 tensor=1" in proc.stdout, proc.stdout


@needs_libtpu
def test_too_large_batch_does_not_fit_with_advice():
  proc = compile_only("--topology=v5e:2x2", *SMALL, "model.vocab_size=32000", "data.seq_len=1024",
                      "train.batch_size=1024")
  assert proc.returncode == 3, proc.stderr[-3000:]
  assert "fits: NO" in proc.stdout
  err = proc.stderr
  assert re.search(r"does not fit in HBM on v5e:2x2 \(TPU v5 lite\): needs [\d.]+ GiB per chip, 15.75 GiB available",
                   err), err
  for change in (r"train.batch_size: lower it \(now 1024 = 256 x 4; about \d+ would fit", r"model.remat=full",
                 r"train.grad_accum_steps=\d+ \(now 1\): the same global batch in micro-batches of \d+, about [\d.]+",
                 r"mesh.fsdp: the state \([\d.]+ MiB per chip\) is already sharded over all 4 chips"):
    assert re.search(change, err), (change, err)


@needs_libtpu
def test_unknown_topology_is_refused_by_name():
  proc = compile_only("--topology=v9z:1x1", *SMALL)
  assert proc.returncode == 2
  assert "--topology 'v9z:1x1': cannot describe this TPU topology" in proc.stderr


def test_num_slices_split_the_data_axis_unless_the_config_says():
  from jaxshare.config import load_config
  from jaxshare.aot.topology import with_slices

  cfg = load_config(None, ["mesh.fsdp=-1"])
  assert with_slices(cfg, None) is cfg and with_slices(cfg, 1) is cfg
  assert with_slices(cfg, 4).mesh.dcn_data == 4
  fsdp_across = load_config(None, ["mesh.fsdp=-1", "mesh.dcn_fsdp=2"])
  assert with_slices(fsdp_across, 2) is fsdp_across
  with pytest.raises(ConfigError, match="--num-slices 4: must be >= 1 and match mesh.dcn_data x .* = 2"):
    with_slices(fsdp_across, 4)
