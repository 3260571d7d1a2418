#!/usr/bin/env python
"""Run a sweep of config variants (and seeds): the command line of jaxshare.sweep (``--help`` shows the sweep file's
format)."""

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # run as a script from anywhere: jaxshare is importable without an install
  sys.path.insert(0, str(REPO))

from jaxshare.sweep.__main__ import main  # noqa: E402

if __name__ == "__main__":
  sys.exit(main())
