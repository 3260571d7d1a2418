"""``attention.impl=auto`` reads its table (jaxshare/kernels/routes.py, issue 62): every platform, role and dtype has
a row, docs/kernels.md shows the table as the code holds it, and every row's calls, traced for the row's platform,
run the row's implementation.

The kernels are replaced by recorders that return arrays of the contract's shapes: what runs is the question here, and
the kernels' numbers are the equivalence tests' (tests/equivalence/test_splash.py, test_cudnn.py, test_flash*.py);
tests/integration/aot compiles the real library kernels for TPUs and H100s.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import pytest

from conftest import REPO
from jaxshare.config.choices import AttentionImpl
from jaxshare.kernels import dispatch, flash, pallas, routes, tuning, xla
from jaxshare.kernels.routes import Role

DTYPES = (jnp.bfloat16, jnp.float16, jnp.float32)
B, T, H, G, E, D = 1, 128, 4, 2, 64, 64
CHAIN_WIDTH = 80  # a LISA_plus chain's features: wider than V


def cases() -> list[tuple[routes.Route, Role, object]]:
  """Every (row, role, dtype) the first-match rule gives that row."""
  return [(routes.route(p, role, dtype), role, dtype) for p in routes.PLATFORMS for role in Role for dtype in DTYPES]


def test_every_platform_role_and_dtype_has_a_route_and_every_row_routes_some():
  chosen = {id(row) for row, _, _ in cases()}
  unused = [row.cells[:3] for row in routes.ROUTES if id(row) not in chosen]
  assert not unused, f"rows that an earlier row always wins over: {unused}"
  with pytest.raises(LookupError, match="no route.*'metal'.*platforms: tpu, gpu, cpu"):
    routes.route("metal", Role.OWN, jnp.bfloat16)


def test_docs_show_the_table_the_dispatch_reads():
  assert routes.markdown() in (REPO / "docs" / "kernels.md").read_text()


def test_roles_from_shapes():
  q, kv = jnp.zeros((B, T, H, E)), jnp.zeros((B, T, G, D))
  assert routes.role_of(q, kv, kv) == Role.OWN
  assert routes.role_of(q, kv, kv, reuse=True) == Role.REUSE
  assert routes.role_of(jnp.zeros((B, T, H, CHAIN_WIDTH)), jnp.zeros((B, T, G, CHAIN_WIDTH)), kv) == Role.CHAIN
  assert routes.role_of(q[:, :T // 2], kv, kv) == Role.CROSS


@pytest.fixture
def recorded(monkeypatch):
  """``attention.impl=auto`` built with every kernel replaced by a recorder of its implementation's name, and the
  list it records into."""
  calls: list[AttentionImpl] = []

  def recorder(impl: AttentionImpl, lse: bool = False):
    def kernel(q, k, *rest, return_lse=False, **_):
      v = rest[1] if lse else rest[0]
      width = v[0].shape[-1] if isinstance(v, tuple) else v.shape[-1]
      calls.append(impl)
      out = jnp.zeros(q.shape[:3] + (width,), q.dtype)
      return (out, jnp.zeros((q.shape[0], q.shape[2], q.shape[1]), jnp.float32)) if return_lse else out
    return kernel

  for name in ("attention", "decode_attention"):
    monkeypatch.setattr(pallas, name, recorder(AttentionImpl.PALLAS))
  monkeypatch.setattr(pallas, "attention_from_lse", recorder(AttentionImpl.PALLAS, lse=True))
  for name in ("attention", "attention_backward"):
    monkeypatch.setattr(flash, name, recorder(AttentionImpl.PALLAS))
  monkeypatch.setattr(flash, "attention_from_lse", recorder(AttentionImpl.PALLAS, lse=True))
  monkeypatch.setattr(xla, "attention", recorder(AttentionImpl.XLA))
  xla_ops = dispatch.AttentionOps(recorder(AttentionImpl.XLA), recorder(AttentionImpl.XLA, lse=True),
                                  recorder(AttentionImpl.XLA))
  monkeypatch.setattr(dispatch, "_XLA", xla_ops)
  monkeypatch.setattr(dispatch, "_recomputed_reuse", recorder(AttentionImpl.XLA, lse=True))
  # the libraries' own device checks answer for this host: none here
  for impl in (AttentionImpl.SPLASH, AttentionImpl.CUDNN):
    library = dispatch._LIBRARIES[impl]
    monkeypatch.setitem(dispatch._LIBRARIES, impl, dataclasses.replace(
      library, attention=recorder(impl), device_unsupported=None,
      unsupported=lambda q, k, v: "lengths differ" if q.shape[1] != k.shape[1] else None))
  return calls


def _call(role: Role, dtype, platform: str) -> None:
  """Trace one call of ``role`` in ``dtype`` through ``attention.impl=auto``, compiled for ``platform``."""
  ops = dispatch.get_attention("auto")
  e = CHAIN_WIDTH if role == Role.CHAIN else E
  q = jax.ShapeDtypeStruct((B, T // 2 if role == Role.CROSS else T, H, e), dtype)
  k, v = jax.ShapeDtypeStruct((B, T, G, e), dtype), jax.ShapeDtypeStruct((B, T, G, D), dtype)
  seg = jax.ShapeDtypeStruct((B, T), jnp.int32)
  q_seg = jax.ShapeDtypeStruct(q.shape[:2], jnp.int32)
  scale = E ** -0.5
  if role == Role.DECODE:
    blocks = lambda x: (jax.ShapeDtypeStruct((B, G, T, x.shape[-1]), dtype),) * 2  # noqa: E731  (cache, new rows)
    mask = jax.ShapeDtypeStruct((B, 1, 2 * T), jnp.bool_)
    jax.eval_shape(lambda q, k, v, m: ops.decode_attention(q, k, v, m, scale=scale, dtype=dtype),
                   jax.ShapeDtypeStruct((B, 1, H, E), dtype), blocks(k), blocks(v), mask)
  elif role == Role.CONTEXT:  # the kernels each device runs on its query chunks
    forward, _, _ = dispatch._context_kernels("auto", dtype)
    jax.eval_shape(lambda q, k, v, s: forward(q, k, v, s, s, causal=True, scale=scale), q, k, v, seg)
  elif role == Role.REUSE:  # the source ran the row's kernel: a library hands on no LSE, jaxshare's kernels one
    lse = None if routes.route(platform, role, dtype).impl in (AttentionImpl.SPLASH, AttentionImpl.CUDNN) else \
      jax.ShapeDtypeStruct((B, H, T), jnp.float32)
    jax.eval_shape(lambda q, k, lse, v, s: ops.attention_from_lse(q, k, lse, v, s, s, scale=scale), q, k, lse, v, seg)
  else:
    jax.eval_shape(lambda q, k, v, qs, s: ops.attention(q, k, v, qs, s, causal=True, scale=scale), q, k, v, q_seg, seg)


@pytest.mark.parametrize("row, role, dtype", cases(),
                         ids=[f"{row.platform}-{role.name}-{jnp.dtype(dtype).name}" for row, role, dtype in cases()])
def test_every_row_runs_its_implementation(row, role, dtype, recorded, monkeypatch):
  monkeypatch.setattr(tuning, "platform", lambda: row.platform)
  # rows of at most one document, or of more than the library's packed layout takes
  with dispatch.documents_known(17 if role == Role.DOCUMENTS else 1):
    _call(role, dtype, row.platform)
  assert recorded and set(recorded) == {row.impl}, (row.cells, role, jnp.dtype(dtype).name, recorded)
