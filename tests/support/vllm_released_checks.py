"""jaxshare's vLLM plugin inside the released vLLM (0.33), driven on this CPU: run by
tests/equivalence/test_vllm_released.py in the ``.vllm/`` environment ``make test`` installs (vLLM's Python without its
CUDA kernels, transformers 5.16.1, the lowest the ``hf`` extra allows). Not named ``test_*``: the main suite's
transformers is newer than vLLM allows.

For each K/V-sharing export (CLA, MLKV, NeoX-MLKV, a sliding-window tied CLA): vLLM's plugin loader registers the
model through the entry point, vLLM resolves the engine config, its CPU model runner builds the model with vLLM's own
loader (parameters equal to the checkpoint), gives KV-cache specs to producer layers only (each consumer's attention
matches its producer's heads, width and window, which vLLM does not check), its allocator makes as many more blocks
from the same memory as the accounting says, and a profiling-mode forward pass runs. Schedules vLLM cannot express,
tensor parallelism and an attention backend that refuses sharing are refused with one line. The attention arithmetic
itself (vLLM's CPU and CUDA kernels are not in this environment) is tested against a stand-in in
tests/equivalence/test_vllm_model.py.
"""

from __future__ import annotations

import socket

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

vllm = pytest.importorskip("vllm", reason="runs in the .vllm/ environment (tests/equivalence/test_vllm_released.py)")

from vllm import ModelRegistry  # noqa: E402
from vllm.config import set_current_vllm_config  # noqa: E402
from vllm.engine.arg_utils import EngineArgs  # noqa: E402

from jaxshare.config.catalogue import schedule_matrix  # noqa: E402
from jaxshare import accounting  # noqa: E402
from jaxshare.serve.vllm_layers import VLLMUnsupportedError  # noqa: E402
from jaxshare.serve.vllm_model import JaxshareForCausalLM  # noqa: E402

from support.hf import export_remote  # noqa: E402

CASES = schedule_matrix("remote_code")

# The K/V exports vLLM serves, and how many times dense's KV-cache blocks each gets from the same memory: CLA halves
# the producers; MLKV (kv_layers=2, kv_heads=2 of 4 layers x 4 heads) quarters the K/V heads.
SERVED = {"cla": 2, "mlkv": 4, "neox_mlkv": 4, "window_tied_cla": 2}
KV_MEMORY = 64 * 2**20  # bytes given to vLLM's KV-cache allocator


_EXPORTS: dict[str, tuple] = {}  # kind -> (cfg, setup, directory)
_ROOT: list = []  # pytest's directory for the exports, set by the fixture


@pytest.fixture(scope="module", autouse=True)
def exports(tmp_path_factory):
  """Tiny random exports of ``CASES[kind]`` made on first use (``_export_dir``), and vLLM's model-parallel groups
  for one CPU process (gloo), as its CPU worker makes them."""
  from vllm.distributed import ensure_model_parallel_initialized, init_distributed_environment

  _ROOT[:] = [tmp_path_factory.mktemp("vllm_exports")]
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
  with set_current_vllm_config(_engine_config(_export_dir("cla"))):
    init_distributed_environment(world_size=1, rank=0, local_rank=0,
                                 distributed_init_method=f"tcp://127.0.0.1:{port}", backend="gloo")
    ensure_model_parallel_initialized(1, 1)


def _export_dir(kind: str):
  """The export directory of ``CASES[kind]`` (``_EXPORTS[kind]`` is ``(cfg, setup, directory)``)."""
  if kind not in _EXPORTS:
    root = _ROOT[0] / kind
    root.mkdir()
    cfg, setup, _, out = export_remote(root, CASES[kind])
    _EXPORTS[kind] = cfg, setup, out
  return _EXPORTS[kind][2]


def _engine_config(directory, dtype: str = "float32"):
  return EngineArgs(model=str(directory), trust_remote_code=True, dtype=dtype, enforce_eager=True,
                    max_model_len=256).create_engine_config()


def _runner(directory, dtype: str = "float32"):
  """vLLM's CPU model runner with the export loaded by vLLM's own model loader."""
  from vllm.v1.worker.cpu_model_runner import CPUModelRunner

  config = _engine_config(directory, dtype)
  with set_current_vllm_config(config):
    runner = CPUModelRunner(config, torch.device("cpu"))
    runner.load_model()
  return config, runner


def _blocks(config, spec) -> int:
  """The KV-cache blocks vLLM's engine core makes from :data:`KV_MEMORY` for the runner's ``spec``."""
  from vllm.distributed.kv_transfer.kv_connector.utils import get_current_attn_backends
  from vllm.v1.attention.backends.utils import get_supported_kv_cache_layouts, resolve_kv_cache_layout
  from vllm.v1.core.kv_cache_planning import get_global_kv_cache_groups, get_kv_cache_configs

  with set_current_vllm_config(config):
    layouts = [[layout.name for layout in get_supported_kv_cache_layouts(get_current_attn_backends(config))]]
    resolve_kv_cache_layout(config, layouts, spec.values())
    groups = get_global_kv_cache_groups(config, [spec])
    (kv_config,) = get_kv_cache_configs(config, [spec], [KV_MEMORY], groups)
  return kv_config.num_blocks


def test_the_entry_point_registers_the_model_with_vllm():
  """vLLM's plugin loader finds jaxshare's entry point and its function registers the class vLLM then inspects (an
  engine config is refused with "does not support --runner generate" when the class misses vLLM's protocol)."""
  from vllm.plugins import load_plugins_by_group

  from jaxshare.serve import vllm_plugin

  assert load_plugins_by_group("vllm.general_plugins")["jaxshare"] is vllm_plugin.register
  vllm_plugin.register()  # again: idempotent (vLLM calls it in every process it starts)
  assert "JaxshareForCausalLM" in ModelRegistry.get_supported_archs()
  config = _engine_config(_export_dir("cla"))
  assert config.model_config.architectures == ["JaxshareForCausalLM"]
  assert config.model_config.hf_config.model_type == "jaxshare"
  assert ModelRegistry.resolve_model_cls(["JaxshareForCausalLM"], config.model_config)[0] is JaxshareForCausalLM


@pytest.mark.parametrize("kind", SERVED)
def test_vllm_builds_the_export_and_caches_only_producers(kind):
  directory = _export_dir(kind)
  cfg, setup, _ = _EXPORTS[kind]
  config, runner = _runner(directory)
  model = runner.model
  assert isinstance(model, JaxshareForCausalLM)
  plans = config.model_config.hf_config.layer_plans

  # vLLM's own loader: every parameter equals the checkpoint's tensor (the tied head is the embedding)
  weights = load_file(directory / "model.safetensors")
  params = dict(model.named_parameters())
  assert set(params) == set(weights) - ({"lm_head.weight"} & set(weights) if cfg.model.tie_embeddings else set())
  state = model.state_dict()
  for name, tensor in weights.items():
    np.testing.assert_array_equal(state[name].numpy(), tensor.numpy(), err_msg=name)

  # KV-cache specs for producers only; each consumer reads an earlier producer of the same shape
  name = "model.layers.{}.self_attn.attn".format
  producers = [i for i, p in enumerate(plans) if p["kv_source"] == i]
  spec = runner.get_kv_cache_spec()
  assert sorted(spec) == sorted(name(i) for i in producers)
  assert runner.shared_kv_cache_layers == {name(i): name(p["kv_source"]) for i, p in enumerate(plans)
                                           if p["kv_source"] != i}
  layers = model.model.layers
  for i, p in enumerate(plans):
    mine, theirs = layers[i].self_attn.attn, layers[p["kv_source"]].self_attn.attn
    assert (mine.num_kv_heads, mine.head_size, mine.sliding_window) == (
      theirs.num_kv_heads, theirs.head_size, theirs.sliding_window)
  assert layers[0].self_attn.attn.sliding_window == (cfg.model.sliding_window or None)

  # vLLM's allocator: blocks from the same memory, in proportion to the accounting's bytes per token
  per_token = accounting.kv_cache_bytes_per_token(cfg.model, setup.schedule, bytes_per_element=4)
  blocks = _blocks(config, spec)
  (block_tokens,) = {layer.block_size for layer in spec.values()}  # a sliding window picks its own block size
  assert blocks == KV_MEMORY // (per_token * block_tokens)
  hf = config.model_config.hf_config
  dense = 2 * hf.num_hidden_layers * hf.num_attention_heads * hf.head_dim * 4  # a dense model's bytes per token
  assert blocks == SERVED[kind] * (KV_MEMORY // (dense * block_tokens))

  # a profiling-mode forward pass through vLLM's forward context (its dummy run). With no attention metadata the
  # backend returns its output buffer unwritten (torch.empty), so only the shape and dtype are defined.
  with set_current_vllm_config(config):
    hidden, _ = runner._dummy_run(16)
  assert hidden.shape == (16, hf.hidden_size) and hidden.dtype == torch.float32


@pytest.mark.parametrize("kind, feature", [("sa", "probability reuse"), ("uniattn", "probability reuse"),
                                           ("lisa_plus", "logit reuse"), ("directshare", "head-wise weight tying"),
                                           ("per_layer_gqa", "per-layer K/V head counts")])
def test_vllm_refuses_what_its_attention_cannot_express(kind, feature):
  with pytest.raises(VLLMUnsupportedError, match=f"vLLM cannot serve {feature}"):
    _runner(_export_dir(kind))


def test_tensor_parallelism_and_foreign_weights_are_refused():
  config = _engine_config(_export_dir("cla"))
  config.parallel_config.tensor_parallel_size = 2
  with set_current_vllm_config(config), pytest.raises(VLLMUnsupportedError, match="tensor_parallel_size=2: .* one GPU"):
    JaxshareForCausalLM(vllm_config=config)
  _, runner = _runner(_export_dir("cla"))
  with pytest.raises(ValueError, match=r"'model.layers.1.self_attn.k_proj.weight' has no parameter"):
    runner.model.load_weights([("model.layers.1.self_attn.k_proj.weight", torch.zeros(8, 32))])
  with pytest.raises(ValueError, match=r"'model.norm.weight' has shape \(3,\); the model expects \(32,\)"):
    runner.model.load_weights([("model.norm.weight", torch.zeros(3))])


def test_a_backend_that_refuses_sharing_is_named_in_one_line(monkeypatch):
  """On CUDA, float32 at head width < 32 leaves vLLM only FlexAttention, which raises on K/V sharing. The CPU
  platform always picks its own backend, so vLLM's selector is made to return FlexAttention here; the refusal is
  FlexAttention's own."""
  from vllm.model_executor.layers.attention import attention
  from vllm.v1.attention.backends.flex_attention import FlexAttentionBackend

  monkeypatch.setattr(attention, "get_attn_backend", lambda *args, **kwargs: FlexAttentionBackend)
  with pytest.raises(VLLMUnsupportedError) as err:
    _runner(_export_dir("cla"))
  message = str(err.value)
  assert "\n" not in message
  assert all(s in message for s in ("model.layers.1.self_attn.attn", "torch.float32", "head width 8",
                                    "FlexAttention does not support kv sharing", "bfloat16"))
