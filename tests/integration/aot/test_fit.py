"""The ahead-of-time fit check (``train.py --compile-only``, jaxshare/aot/): accelerator types and GPU cluster names
name topologies, the traced FLOP count follows scans and shard_map, and, with libtpu or jax's CUDA plugin, a small
model's train step compiles for a TPU topology (and two slices of it) or a node of 8 H100s and fits while a too-large
batch is refused with advice and exit code 3. Those cases run train.py in a child process: libtpu and the plugin are
initialised there, not in the test workers."""

import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec as P

from conftest import OPTIMIZED_ENV, REPO, needs_cuda_plugin, needs_libtpu
from jaxshare.config import ConfigError
from jaxshare.aot.topology import GPUS, gpu_topology, hbm_bytes, topology_name


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
  ("v3-8", "a TPU topology (v5e:16x16"), ("tpu", "a TPU topology (v5e:16x16")])
def test_bad_accelerator_types_are_refused_by_name(name, message):
  with pytest.raises(ConfigError, match=re.escape(message)):
    topology_name(name)


@pytest.mark.parametrize("name,parsed", [("h100:8", ("h100", 1, 8)), ("h100:4x8", ("h100", 4, 8)),
                                         ("a100:8", ("a100", 1, 8)), ("h200:2x4", ("h200", 2, 4)),
                                         ("b200:8", ("b200", 1, 8)), ("v5e:2x2", None), ("v4:8", None)])
def test_gpu_cluster_names(name, parsed):
  assert gpu_topology(name) == parsed
  if parsed:
    assert topology_name(name) == name


@pytest.mark.parametrize("name", ["h999:8", "h100:0", "h100:0x8", "a100:2x0"])
def test_bad_gpu_cluster_names_are_refused_by_name(name):
  with pytest.raises(ConfigError, match=re.escape(f"--topology {name!r}: a GPU topology is <gpu>:<gpus per node>")):
    topology_name(name)


@needs_cuda_plugin
def test_every_gpu_target_describes_its_devices():
  """Each shipped GPU target parses in the installed CUDA plugin and describes two nodes of devices of its kind,
  whose memory and bf16 peak the fit check knows."""
  code = ("from jaxshare.aot import topology; topology.use_host_compiler()\n"
          "from jaxshare.train.metrics import vendor_peak_tflops\n"
          f"for gpu in {sorted(GPUS)}:\n"
          "  devices = topology.topology_devices(gpu + ':2x4')\n"
          "  kind = devices[0].device_kind\n"
          "  print(gpu, len(devices), sorted({d.process_index for d in devices}), kind, devices[0].compute_capability,"
          " topology.hbm_bytes(kind), vendor_peak_tflops(kind), sep='|')\n")
  proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300,
                        env=OPTIMIZED_ENV)
  assert proc.returncode == 0, proc.stderr[-3000:]
  rows = {r.split("|")[0]: r.split("|")[1:] for r in proc.stdout.splitlines()}
  assert {g: (n, nodes) for g, (n, nodes, *_) in rows.items()} == {g: ("8", "[0, 1]") for g in GPUS}
  assert {g: (kind, cc) for g, (_, _, kind, cc, *_) in rows.items()} == {
    "h100": ("NVIDIA H100 80GB HBM3", "9.0"), "h200": ("NVIDIA H200 141GB HBM3e", "9.0"),
    "a100": ("NVIDIA A100-SXM4-80GB", "8.0"), "b200": ("NVIDIA B200", "10.0")}
  assert {g: round(int(r[4]) / 1e9) for g, r in rows.items()} == {"h100": 85, "h200": 151, "a100": 85, "b200": 192}
  assert {g: float(r[5]) for g, r in rows.items()} == {"h100": 989.0, "h200": 989.0, "a100": 312.0, "b200": 2250.0}


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
  assert "8 x TPU v5 lite, 2 slices" in proc.stdout, proc.stdout
  assert "mesh data=2 fsdp=4 context=1 tensor=1" in proc.stdout, proc.stdout


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


@needs_cuda_plugin
def test_small_model_fits_on_an_h100_node_and_a_large_batch_does_not():
  """The GPU fit check: XLA's GPU compiler reports a peak but refuses nothing, so the verdict compares it with jax's
  share of the device (XLA_PYTHON_CLIENT_MEM_FRACTION, 0.75 of 79.11 GiB by default, 0.9 when set)."""
  proc = compile_only("--topology=h100:8", *SMALL, "train.batch_size=8", "attention.impl=pallas")
  assert proc.returncode == 0, proc.stderr[-3000:]
  out = proc.stdout
  assert "compiled for h100:8: 8 x NVIDIA H100 80GB HBM3" in out and "mesh data=1 fsdp=8 context=1 tensor=1" in out, out
  hbm = re.search(r"HBM per chip: ([\d.]+ [GM]iB) \(compiler's peak\) of 59.33 GiB usable \(jax's share: "
                  r"XLA_PYTHON_CLIENT_MEM_FRACTION=0.75; 79.11 GiB HBM\)", out).group(1)
  assert 0 < gib(hbm) < 0.1 and "3 Pallas kernel calls" in out and "fits: yes" in out
  proc = subprocess.run([sys.executable, "train.py", "--compile-only", "--topology=h100:8", *SMALL,
                         "model.vocab_size=32000", "data.seq_len=1024", "train.batch_size=8192"], cwd=REPO,
                        capture_output=True, text=True, timeout=600,
                        env={**OPTIMIZED_ENV, "XLA_PYTHON_CLIENT_MEM_FRACTION": "0.9"})
  assert proc.returncode == 3, proc.stderr[-3000:]
  assert "fits: NO" in proc.stdout and "71.20 GiB usable" in proc.stdout, proc.stdout
  assert re.search(r"does not fit in HBM on h100:8 \(NVIDIA H100 80GB HBM3\): needs [\d.]+ GiB per chip, 71.20 GiB "
                   r"available", proc.stderr), proc.stderr
  assert re.search(r"train.batch_size: lower it \(now 8192 = 1024 x 8; about \d+ would fit", proc.stderr)


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
