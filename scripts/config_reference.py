#!/usr/bin/env python
"""Print the Markdown reference of every config field (pasted into README.md; a test keeps them in sync)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from jaxshare.config import documented_fields  # noqa: E402


def main() -> None:
  for group, doc, rows in documented_fields():
    print(f"### `{group}` — {doc}\n")
    print("| field | default | meaning |")
    print("|---|---|---|")
    for name, default, help_text in rows:
      print(f"| `{name}` | `{default!r}` | {help_text.replace('|', chr(92) + '|')} |")
    print()


if __name__ == "__main__":
  main()
