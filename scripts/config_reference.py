#!/usr/bin/env python
"""Print the Markdown reference of every config field (pasted into README.md; a test keeps them in sync)."""

import dataclasses
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from jaxshare.config import Config  # noqa: E402


def main() -> None:
  for group in dataclasses.fields(Config):
    cls = group.default_factory
    print(f"#### `{group.name}` — {cls.__doc__}\n")
    print("| field | default | meaning |")
    print("|---|---|---|")
    for f in dataclasses.fields(cls):
      default = f.default_factory() if f.default is dataclasses.MISSING else f.default
      help_text = f.metadata.get("help", "").replace("|", "\\|")
      print(f"| `{group.name}.{f.name}` | `{default!r}` | {help_text} |")
    print()


if __name__ == "__main__":
  main()
