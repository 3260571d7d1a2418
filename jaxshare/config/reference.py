"""The config's reference documentation, generated from the schema: ``--help-config`` and the field tables of
docs/configuration.md (``scripts/config_reference.py``)."""

from __future__ import annotations

import dataclasses
from typing import Any

from jaxshare.config.schema import Config


def _group_rows(name: str, cls: Any):
  rows, nested = [], []
  for f in dataclasses.fields(cls):
    default = f.default_factory() if f.default is dataclasses.MISSING else f.default
    if dataclasses.is_dataclass(default):
      nested.append((f"{name}.{f.name}", type(default)))
    else:
      rows.append((f"{name}.{f.name}", default, f.metadata.get("help", "")))
  yield name, cls.__doc__, rows
  for sub_name, sub_cls in nested:
    yield from _group_rows(sub_name, sub_cls)


def documented_fields():
  """``(group name, group doc, [(dotted field, default, help)])`` for every group, nested groups included."""
  for group in dataclasses.fields(Config):
    yield from _group_rows(group.name, group.default_factory)


def describe_fields() -> str:
  """Every config field with its default and documentation, grouped; printed by ``--help-config``."""
  lines = []
  for group, doc, rows in documented_fields():
    lines.append(f"{group}:  {doc}")
    lines += [f"  {name} = {default!r}\n      {help_text}" for name, default, help_text in rows]
  return "\n".join(lines)
