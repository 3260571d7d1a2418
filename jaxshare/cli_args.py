"""Command-line parsing where flags may come anywhere, before, between or after the ``key=value`` overrides."""

from __future__ import annotations

import argparse
import sys
from typing import Sequence


def parse_anywhere(parser: argparse.ArgumentParser, argv: Sequence[str] | None,
                   commands: dict[str, argparse.ArgumentParser] | None = None) -> argparse.Namespace:
  """``parser.parse_intermixed_args(argv)``, also for a parser with subcommands (which argparse's intermixed parsing
  refuses): a known command word first hands the rest to that command's parser, intermixed, with ``command`` set.

  Args:
    parser: the whole CLI's parser (its own errors and ``--help`` for anything else).
    argv: the arguments (None: ``sys.argv[1:]``).
    commands: subcommand name -> its parser (from ``add_subparsers().add_parser``), when the CLI has subcommands.

  Raises:
    SystemExit: argparse's usage error or help, as ``parse_args``.
  """
  argv = list(sys.argv[1:] if argv is None else argv)
  if commands is None:
    return parser.parse_intermixed_args(argv)
  if argv and argv[0] in commands:
    args = commands[argv[0]].parse_intermixed_args(argv[1:])
    args.command = argv[0]
    return args
  return parser.parse_args(argv)
