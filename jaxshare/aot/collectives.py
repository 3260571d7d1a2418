"""The bytes a compiled step's collectives move, read from its optimised HLO text: every all-gather, reduce-scatter,
all-reduce, collective permute and all-to-all, times the trip counts of the loops around it, the costliest branch
of a conditional counted once, the share that moves attention K/V apart: the collectives in the ``kv_gather`` scope
(:func:`jaxshare.context.gather_keys` and the attention that reads the gathered keys, whose transpose sums their
gradients), and the reduce-scatters XLA makes of such a sum and the slice after it, which keep no name: those whose
operand is an array of the gathers' gathered shapes.

Bytes moved per device use the ring algorithms' volumes, for a collective over ``n`` devices whose result per
device is ``R`` bytes: all-gather ``R (n-1)/n`` (each device receives the other shards), reduce-scatter ``R (n-1)``
(its operand is ``n R``, of which it sends and receives ``(n-1)/n``), all-reduce ``2 R (n-1)/n`` (a reduce-scatter
and an all-gather), all-to-all ``R (n-1)/n``, collective permute ``R``. They are what the links carry, whatever the
algorithm NCCL or the ICI picks; a step's time bound from them needs the links' bandwidth.
"""

from __future__ import annotations

import dataclasses
import math
import re

import numpy as np

KINDS = ("all-gather", "reduce-scatter", "all-reduce", "collective-permute", "all-to-all")
KV_SCOPE = "kv_gather"  # the named scope of K/V gathers and of the attention that reads them (their transposes)

_COMPUTATION = re.compile(r"^(?:ENTRY )?%?([\w.\-]+) [(].*[)] -> .*\{\s*$")
_OP = re.compile(r"^\s*(?:ROOT )?%?[\w.\-]+ = (.*?) (" + "|".join(KINDS) + r")(-start)?\(")
_ARRAY = re.compile(r"\b(pred|s8|u8|s16|u16|s32|u32|s64|u64|f16|bf16|f32|f64|f8e4m3fn|f8e5m2)\[([\d,]*)\]")
_WHILE = re.compile(r"while\(.*body=%?([\w.\-]+)")
_TRIP = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
_CONDITION = re.compile(r"condition=%?([\w.\-]+)")
_CONSTANT = re.compile(r"^\s*%?([\w.\-]+) = s32\[\]\S* constant\((\d+)\)")
_LESS_THAN = re.compile(r"^\s*ROOT .* compare\(%?[\w.\-]+, %?([\w.\-]+)\), direction=LT")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}|true_computation=%?([\w.\-]+), false_computation=%?([\w.\-]+)")
_CALLS = re.compile(r"(?:to_apply|calls)=%?([\w.\-]+)")
_IOTA_GROUPS = re.compile(r"replica_groups=\[(\d+),(\d+)\]")
_LIST_GROUPS = re.compile(r"replica_groups=\{\{([\d,]*)\}")
_MESH_GROUPS = re.compile(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}")
_ITEM_BYTES = {"pred": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2,
               "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8}


@dataclasses.dataclass(frozen=True)
class Traffic:
  """Bytes one device sends and receives per step, by collective kind, and how many of them move attention K/V.

  Attributes:
    by_kind: ``{kind: bytes}`` for each of :data:`KINDS` present.
    kv: bytes of the collectives in the ``kv_gather`` scope (K/V gathers over the context axis and the reductions
      of their gradients).
    count: collectives executed per step (loop trip counts applied).
  """

  by_kind: dict
  kv: float
  count: int

  @property
  def total(self) -> float:
    return float(sum(self.by_kind.values()))


def _group_size(line: str) -> int:
  if m := _IOTA_GROUPS.search(line):
    return int(m.group(2))
  if m := _LIST_GROUPS.search(line):
    return len([x for x in m.group(1).split(",") if x])
  if m := _MESH_GROUPS.search(line):  # mesh['axis_0'=4,'axis_1'=2] {'axis_0'}: the named axes' sizes
    sizes = dict((k.strip("'"), int(v)) for k, v in (a.split("=") for a in m.group(1).split(",")))
    return math.prod(sizes[a.strip().strip("'")] for a in m.group(2).split(",") if a.strip())
  return 1


def _bytes(shapes: str) -> int:
  return sum(int(np.prod([int(d) for d in dims.split(",") if d] or [1])) * _ITEM_BYTES[dtype]
             for dtype, dims in _ARRAY.findall(shapes))


def _top_level(shapes: str) -> list[str]:
  """The elements of a tuple shape ``(a, (b, c), d)`` at its top level (the shape itself when not a tuple)."""
  shapes = shapes.strip()
  if not shapes.startswith("("):
    return [shapes]
  parts, depth, start = [], 0, 1
  for i, ch in enumerate(shapes):
    depth += ch in "([{" and 1 or ch in ")]}" and -1 or 0
    if (ch == "," and depth == 1) or i == len(shapes) - 1:
      parts.append(shapes[start:i])
      start = i + 1
  return parts


_SYNC_FLAG = re.compile(r"^u32\[\](\{.*\})?$")  # TPU's async permute ends its tuple with two u32[] flags


def _result_bytes(shapes: str, start: bool) -> int:
  """Bytes of an instruction's result per device: all its arrays (a combined collective of several operands), or
  for an async start, whose shape is ``(operands, result)`` (on TPU a permute's ``(operand, result, u32[], u32[])``),
  the result's."""
  if not start:
    return _bytes(shapes)
  parts = _top_level(shapes)
  while len(parts) > 2 and _SYNC_FLAG.match(parts[-1].strip()):
    parts.pop()
  return _bytes(parts[-1])


def _kv_bytes(shapes: str, start: bool) -> int:
  """Bytes of a K/V-scoped collective's result that are K/V: its arrays of three dimensions or more (K/V and their
  gradients are ``[B, T, G, d]``). XLA's all-reduce combiner folds small reductions of the same devices (a norm's
  scale gradient, a scalar) into a K/V reduction, under its metadata."""
  if start:
    return _result_bytes(shapes, start)
  return sum(_bytes(f"{dtype}[{dims}]") for dtype, dims in _ARRAY.findall(shapes)
             if len([d for d in dims.split(",") if d]) >= 3)


def _signature(shapes: str) -> tuple:
  """``(dtype, dims without the ones)`` of each array in ``shapes``: XLA bitcasts unit dimensions in and out."""
  return tuple((dtype, tuple(int(d) for d in dims.split(",") if d and d != "1"))
               for dtype, dims in _ARRAY.findall(shapes))


def _moved(kind: str, result: int, n: int) -> float:
  if kind == "collective-permute":  # each device sends its buffer to one other
    return float(result)
  if n <= 1:
    return 0.0
  share = (n - 1) / n
  return {"all-gather": result * share, "reduce-scatter": result * (n - 1), "all-reduce": 2 * result * share,
          "all-to-all": result * share}[kind]


def _computations(text: str) -> dict[str, list[str]]:
  comps, name, body = {}, None, []
  for line in text.splitlines():
    if name is None:
      if m := _COMPUTATION.match(line):
        name, body = m.group(1), []
    elif line.startswith("}"):
      comps[name], name = body, None
    else:
      body.append(line)
  return comps


def _trips(line: str, comps: dict[str, list[str]]) -> int:
  """A while loop's trip count: XLA's ``known_trip_count`` (GPU), else the bound of a condition ``counter < N`` on a
  constant (TPU programs carry no trip counts; jax's scans count from 0), else 1 (counted once)."""
  if t := _TRIP.search(line):
    return int(t.group(1))
  condition = comps.get(c.group(1), []) if (c := _CONDITION.search(line)) else []
  constants = dict(m.groups() for x in condition if (m := _CONSTANT.match(x)))
  bound = next((m.group(1) for x in condition if (m := _LESS_THAN.match(x))), None)
  return int(constants.get(bound, 1))


def traffic(hlo_text: str) -> Traffic:
  """The collective traffic of one device per step of a compiled program (``compiled.as_text()``)."""
  comps = _computations(hlo_text)
  gathered = {_signature(_top_level(m.group(1))[-1]) for lines in comps.values() for line in lines
              if KV_SCOPE in line and (m := _OP.match(line)) and m.group(2) == "all-gather"}

  def is_kv(line: str, m: re.Match) -> bool:
    if KV_SCOPE in line:
      return True
    return m.group(2) == "reduce-scatter" and bool(m.group(3)) and _signature(_top_level(m.group(1))[0]) in gathered

  entry = next((m.group(1) for line in hlo_text.splitlines() if line.startswith("ENTRY")
                for m in [_COMPUTATION.match(line)] if m), None)
  memo: dict[str, tuple[dict, float, int]] = {}

  def add(a, b, times=1):
    return ({k: a[0].get(k, 0.0) + times * b[0].get(k, 0.0) for k in set(a[0]) | set(b[0])}, a[1] + times * b[1],
            a[2] + times * b[2])

  def visit(name: str, stack: tuple = ()) -> tuple[dict, float, int]:
    if name in memo:
      return memo[name]
    if name not in comps or name in stack:
      return {}, 0.0, 0
    total = ({}, 0.0, 0)
    for line in comps[name]:
      if m := _OP.match(line):
        kind = m.group(2)
        n = _group_size(line)
        moved = _moved(kind, _result_bytes(m.group(1), bool(m.group(3))), n)
        kv = _moved(kind, _kv_bytes(m.group(1), bool(m.group(3))), n) if is_kv(line, m) else 0.0
        total = add(total, ({kind: moved}, kv, 1))
      if w := _WHILE.search(line):
        total = add(total, visit(w.group(1), stack + (name,)), _trips(line, comps))
      elif b := _BRANCHES.search(line):
        names = [x.strip().lstrip("%") for x in (b.group(1) or "").split(",") if x.strip()] or [b.group(2), b.group(3)]
        costs = [visit(n, stack + (name,)) for n in names]
        total = add(total, max(costs, key=lambda c: sum(c[0].values())))
      else:
        for callee in _CALLS.findall(line):
          total = add(total, visit(callee, stack + (name,)))
    memo[name] = total
    return total

  by_kind, kv, count = visit(entry) if entry else ({}, 0.0, 0)
  return Traffic({k: v for k, v in by_kind.items() if v}, kv, count)
