"""Bytes and step times as the compile reports and the fit tables print them (no JAX: the tables render without it)."""

GIB = 2 ** 30


def gib(n: int | None) -> str:
  """Bytes as GiB, or MiB under a tenth of a GiB; "?" when unknown."""
  if n is None:
    return "?"
  return f"{n / GIB:.2f} GiB" if abs(n) >= GIB / 10 else f"{n / 2 ** 20:.1f} MiB"


def ms(seconds: float | None) -> str:
  """A step time in whole milliseconds with thousands separators; "?" when unknown (or zero: no FLOPs counted)."""
  return f"{seconds * 1e3:,.0f} ms" if seconds else "?"
