"""Head-wise sharing's ties: which stored head each layer's heads use (Head-wise Shareable Attention, Alg. 1-2).

The ties are data of a run: chosen once (:mod:`jaxshare.init.headwise`, at conversion or when training starts),
saved beside its checkpoints and in remote-code exports as JSON (:meth:`HeadTies.to_json`), and read back whenever the
run's model is built, never chosen again.
"""

from __future__ import annotations

import dataclasses
import json

MATRICES = ("q", "k", "v")
FORMAT_VERSION = 1


@dataclasses.dataclass(frozen=True)
class HeadTies:
  """Which stored head each layer's heads use, per projection matrix.

  Attributes:
    rows: per matrix (``q``, ``k``, ``v``), the ``(layer, head)`` whose weights each stored row holds (ascending).
    index: per matrix, ``[L][H]`` row of the stored head that layer l's head h uses.
    pairs: the N selected ``(head, matched earlier head)`` pairs as flat indices ``layer * H + head``, per matrix
      (PostShare's penalty pairs).
  """

  rows: dict[str, tuple[tuple[int, int], ...]]
  index: dict[str, tuple[tuple[int, ...], ...]]
  pairs: dict[str, tuple[tuple[int, int], ...]]

  @property
  def num_rows(self) -> int:
    return len(self.rows["q"])

  def check(self, num_layers: int, num_heads: int, tied_heads: int, source: str) -> None:
    """Raise ValueError (naming ``source``) unless these ties fit a model of ``num_layers`` x ``num_heads`` heads
    that ties ``tied_heads`` of them: every matrix indexes each layer's heads into its own stored rows, and each
    stored row is a head of that model."""
    for m in MATRICES:
      shape = (len(self.index[m]), {len(layer) for layer in self.index[m]})
      tied = num_layers * num_heads - len(self.rows[m])
      if shape != (num_layers, {num_heads}) or tied != tied_heads:
        raise ValueError(f"head-wise ties {source} tie {tied} {m} heads over {shape[0]} layers of "
                         f"{sorted(shape[1])} heads; the model ties {tied_heads} over {num_layers} layers of "
                         f"{num_heads} heads")
      if any(not (0 <= layer < num_layers and 0 <= head < num_heads) for layer, head in self.rows[m]):
        raise ValueError(f"head-wise ties {source}: a stored {m} row names a head outside the model's "
                         f"{num_layers}x{num_heads}")

  def to_json(self) -> str:
    """The ties as JSON text (with a format version), what :meth:`from_json` reads."""
    return json.dumps({"format_version": FORMAT_VERSION,
                       **{field: {m: [list(t) for t in getattr(self, field)[m]] for m in MATRICES}
                          for field in ("rows", "index", "pairs")}})

  @classmethod
  def from_json(cls, text: str, source: str) -> HeadTies:
    """Ties from :meth:`to_json`'s text; ``source`` names where it came from in errors.

    Raises:
      ValueError: not JSON, another format version, or not the structure ``to_json`` writes (each matrix's index
        pointing at its rows).
    """
    try:
      data = json.loads(text)
    except json.JSONDecodeError as e:
      raise ValueError(f"head-wise ties {source} are not JSON: {e}") from e
    if not isinstance(data, dict) or data.get("format_version") != FORMAT_VERSION:
      raise ValueError(f"head-wise ties {source} have format_version "
                       f"{data.get('format_version') if isinstance(data, dict) else None!r}; this jaxshare reads "
                       f"{FORMAT_VERSION}")
    try:
      ties = cls(*({m: tuple(tuple(int(a) for a in t) for t in data[field][m]) for m in MATRICES}
                   for field in ("rows", "index", "pairs")))
      bad = [m for m in MATRICES if any(not 0 <= r < len(ties.rows[m]) for layer in ties.index[m] for r in layer)]
    except (KeyError, TypeError, ValueError) as e:
      raise ValueError(f"head-wise ties {source} are malformed: {e!r}") from e
    if bad:
      raise ValueError(f"head-wise ties {source} are malformed: the index of {bad} points past its stored rows")
    return ties


@dataclasses.dataclass(frozen=True)
class PostSharePairs:
  """PostShare's penalised head pairs (Head-wise Shareable Attention, Sec. 4.3): chosen once when a PostShare run
  starts, kept in its run directory, and tied exactly by a head-wise run initialised from it.

  Attributes:
    pairs: per matrix (``q``, ``k``, ``v``), the ``(head, matched earlier head)`` pairs as flat indices
      ``layer * H + head``.
    match: the match function they were chosen by (``schedule.headwise.match``).
    ratio: ``train.postshare_ratio``, the share of heads they pair.
  """

  pairs: dict[str, tuple[tuple[int, int], ...]]
  match: str
  ratio: float

  def to_json(self) -> str:
    """The pairs as JSON text, what :meth:`from_json` reads."""
    return json.dumps({"match": self.match, "ratio": self.ratio,
                       "pairs": {m: [list(p) for p in self.pairs[m]] for m in MATRICES}})

  @classmethod
  def from_json(cls, text: str, source: str) -> PostSharePairs:
    """Pairs from :meth:`to_json`'s text; ``source`` names where it came from in errors.

    Raises:
      ValueError: not JSON, or not ``{match, ratio, pairs: {q, k, v: [[i, j], ...]}}``.
    """
    try:
      data = json.loads(text)
      if not isinstance(data, dict) or set(data) != {"match", "ratio", "pairs"} or set(data["pairs"]) != set(MATRICES):
        raise ValueError("expected {match, ratio, pairs: {q, k, v}}")
      return cls({m: tuple((int(i), int(j)) for i, j in data["pairs"][m]) for m in MATRICES}, str(data["match"]),
                 float(data["ratio"]))
    except (KeyError, TypeError, ValueError) as e:
      raise ValueError(f"PostShare pairs {source} are unreadable or malformed: {e}") from e
