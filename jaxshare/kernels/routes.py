"""``attention.impl=auto`` as data: which implementation runs each attention role, by platform and compute dtype,
and the measurement or limit behind each choice. :mod:`jaxshare.kernels.dispatch` routes every call by
:func:`route`, docs/kernels.md shows :func:`markdown`, and tests/unit/kernels/test_routes.py traces every row's
calls and checks that the row's implementation ran.

What a row does not decide: arguments an implementation refuses for their shapes (head widths, K/V head counts, a
head's K/V too large for on-chip memory) run the next implementation of the same family down (a library kernel:
jaxshare's kernels; jaxshare's kernels: XLA), with one warning naming why.
"""

from __future__ import annotations

import dataclasses
import enum

import jax.numpy as jnp

from jaxshare.config.choices import AttentionImpl


class Role(enum.StrEnum):
  """An attention call as the routing tells them apart (values: as docs/kernels.md names them)."""

  OWN = "own scores (dense, GQA/MQA, producers), K/V consumers"
  REUSE = "probability reuse (SA, UniAttn)"
  CHAIN = "LISA_plus / DS chains"  # features wider than V: [q/√d, q_LR/√r, ...]
  CROSS = "queries and keys of different lengths"
  DECODE = "decode"
  DOCUMENTS = "rows of more than 16 documents"  # more than the library's packed layout takes
  CONTEXT = "every softmax role under context parallelism (mesh.context > 1)"


class Dtypes(enum.StrEnum):
  """The compute dtypes of a row: half precision (what the library kernels take), float32, or any."""

  HALF = "bf16/fp16"
  FLOAT32 = "float32"
  ANY = "any"

  def holds(self, dtype) -> bool:
    half = jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
    return self == Dtypes.ANY or half == (self == Dtypes.HALF)


ALL_ROLES = tuple(Role)
SOFTMAX_ROLES = (Role.OWN, Role.REUSE, Role.CHAIN)


@dataclasses.dataclass(frozen=True)
class Route:
  """One row: on ``platform``, calls of ``roles`` in ``dtypes`` run ``impl``.

  Attributes:
    platform: ``tpu``, ``gpu`` or ``cpu`` (the platform compiled for: :func:`jaxshare.kernels.tuning.platform`).
    roles: the roles the row routes; ``label`` names them in the docs (default: the one role's name).
    dtypes: the compute dtypes it routes (the queries' dtype).
    impl: what runs: splash, cudnn, pallas (jaxshare's kernels) or xla.
    runs: what runs, as the docs say it (how the implementation is applied to these roles).
    why: the measurement or the limit behind the choice.
  """

  platform: str
  roles: tuple[Role, ...]
  dtypes: Dtypes
  impl: AttentionImpl
  runs: str
  why: str
  label: str = ""

  def routes(self, platform: str, role: Role, dtype) -> bool:
    return platform == self.platform and role in self.roles and self.dtypes.holds(dtype)

  @property
  def cells(self) -> tuple[str, str, str, str]:
    """The row as docs/kernels.md shows it: platform, role, what runs, why."""
    return self.platform.upper(), self.label or self.roles[0].value, self.runs, self.why


# First matching row wins. On TPU and GPU the library kernel runs what it takes; jaxshare's kernels the rest.
ROUTES = (
  Route("tpu", (Role.CONTEXT,), Dtypes.ANY, AttentionImpl.PALLAS,
        "pallas (Mosaic) by query offset where a head's whole K/V fit VMEM, else xla",
        "splash's mask is static per query shard and cannot follow the load-balanced layout's per-device offsets"),
  Route("tpu", (Role.DECODE,), Dtypes.ANY, AttentionImpl.PALLAS, "pallas decode",
        "the split-K kernel over the shared cache; no library kernel reads it"),
  Route("tpu", (Role.CROSS,), Dtypes.ANY, AttentionImpl.PALLAS, "pallas (Mosaic)",
        "splash attends a sequence to itself only"),
  Route("tpu", (Role.OWN, Role.DOCUMENTS), Dtypes.ANY, AttentionImpl.SPLASH, "splash",
        "the library kernel MaxText runs on TPUs; compiles here for v5e, v5p and v6e; not yet timed on a TPU"),
  Route("tpu", (Role.REUSE,), Dtypes.ANY, AttentionImpl.SPLASH, "splash over the source's Q and K",
        "the same kernel as dense attention, so reuse costs what dense attention does"),
  Route("tpu", (Role.CHAIN,), Dtypes.ANY, AttentionImpl.SPLASH, "splash over the concatenated features",
        "as own scores"),
  Route("gpu", (Role.CONTEXT,), Dtypes.ANY, AttentionImpl.PALLAS, "pallas (Triton) by query offset",
        "cuDNN's causal mask (jax 0.10) aligns queries and keys at the start and takes no query offset; the Triton "
        "kernels skip a chunk's invisible key blocks, so every device does the same work"),
  Route("gpu", (Role.DECODE,), Dtypes.ANY, AttentionImpl.PALLAS, "pallas decode",
        "the split-K kernel over the shared cache; no library kernel reads it"),
  Route("gpu", (Role.CROSS,), Dtypes.ANY, AttentionImpl.PALLAS, "pallas (Triton)",
        "cuDNN's flash attention (jax 0.10) attends a sequence to itself only"),
  Route("gpu", SOFTMAX_ROLES + (Role.DOCUMENTS,), Dtypes.FLOAT32, AttentionImpl.PALLAS, "pallas (Triton)",
        "cuDNN takes bf16/fp16 only; the ~1.2B LISA_plus step ran at 0.61x dense's tokens/s on an H200",
        label="LISA_plus / DS chains (float32 features), float32 models"),
  Route("gpu", (Role.DOCUMENTS,), Dtypes.HALF, AttentionImpl.PALLAS, "pallas (Triton)",
        "cuDNN's packed layout sizes its work by the documents per row (M = T asked 4.1 TiB at T = 16k); chosen once "
        "per micro-batch", label="rows of more than 16 documents (one before Hopper: no packed layout)"),
  Route("gpu", (Role.OWN,), Dtypes.HALF, AttentionImpl.CUDNN, "cudnn (bf16/fp16)",
        "one H200, ~1.2B step: dense 63,045 tok/s against 58,399 with Pallas at T = 2048 (1.08x), 51,671 against "
        "41,415 at T = 8192 (1.25x); fwd+bwd at T = 4096, d = 128: 2.285 ms against 4.091 ms"),
  Route("gpu", (Role.REUSE,), Dtypes.HALF, AttentionImpl.CUDNN, "cudnn over the source's Q and K",
        "2.292 ms fwd+bwd at T = 4096, d = 128: as dense, and 1.29x faster than the Pallas reuse kernel (2.949 ms); "
        "the UniAttn step needs ~5% more HBM per sequence than with Pallas (docs/scale-out.md)"),
  Route("gpu", (Role.CHAIN,), Dtypes.HALF, AttentionImpl.CUDNN, "cudnn, Q/K wider than V (Hopper)",
        "jax's MLA path (cuDNN >= 9.10); compiles for an H100 here, not yet timed on a GPU",
        label="LISA_plus chains read in bf16 (attention.chain_dtype=compute)"),
  Route("cpu", ALL_ROLES, Dtypes.ANY, AttentionImpl.XLA, "xla",
        "the FlashAttention-style XLA backward: the fastest here", label="every role"),
)
PLATFORMS = ("tpu", "gpu", "cpu")


def route(platform: str, role: Role, dtype) -> Route:
  """The row that routes a call of ``role`` computing in ``dtype`` on ``platform`` (the first that matches).

  Raises:
    LookupError: no row routes it (an unknown platform: every known platform's every role has one).
  """
  for row in ROUTES:
    if row.routes(platform, role, dtype):
      return row
  raise LookupError(f"attention.impl=auto has no route for {role.value!r} in {jnp.dtype(dtype).name} on "
                    f"{platform!r}; platforms: {', '.join(PLATFORMS)}")


def role_of(q, k, v, *, reuse: bool = False) -> Role:
  """The role of a softmax call of ``q [B,T,H,e]``, ``k [B,S,G,e]``, ``v [B,S,G,d]`` (arrays or shape structs):
  queries and keys of different lengths, features wider than V (a LISA_plus chain), probability reuse or own
  scores. Decode, context parallelism and the documents per row are known to the caller, not from the shapes."""
  if q.shape[1] != k.shape[1]:
    return Role.CROSS
  if q.shape[3] != v.shape[3]:
    return Role.CHAIN
  return Role.REUSE if reuse else Role.OWN


def markdown() -> str:
  """The routing table as docs/kernels.md shows it."""
  lines = ["| platform | role | runs | why |", "|---|---|---|---|"]
  return "\n".join(lines + ["| " + " | ".join(row.cells) + " |" for row in ROUTES])
