"""Flags may come anywhere on every command line that takes ``key=value`` overrides: before, between or after them
(``train.py --config C schedule.kind=cla --no-eval train.steps=5`` was refused: "unrecognized arguments")."""

import argparse

import pytest

import eval as eval_py
import train
from jaxshare.cli_args import parse_anywhere
from jaxshare.convert.__main__ import parse_args as convert_args
from jaxshare.data.__main__ import parse_args as data_args


@pytest.mark.parametrize("parse,orders", [
  (train.parse_args, [["--config", "C", "a=1", "b=2", "--no-eval"], ["--config", "C", "a=1", "--no-eval", "b=2"],
                      ["a=1", "--no-eval", "b=2", "--config", "C"], ["--no-eval", "a=1", "--config=C", "b=2"]]),
  (convert_args, [["uptrain", "S", "O", "a=1", "b=2", "--calibration-batches", "3"],
                  ["uptrain", "S", "--calibration-batches", "3", "O", "a=1", "b=2"],
                  ["uptrain", "S", "O", "a=1", "--calibration-batches=3", "b=2"]]),
  (convert_args, [["import", "H", "R", "a=1", "b=2"], ["import", "H", "R", "a=1", "b=2"]]),
  (eval_py.parse_args, [["generate", "R", "--prompt", "P", "--no-cache"],
                        ["generate", "--no-cache", "R", "--prompt", "P"]]),
  (eval_py.parse_args, [["R", "--json"], ["report", "--json", "R"]]),
  (data_args, [["prepare", "--out", "O", "a.txt", "b/", "--workers", "2"],
               ["prepare", "a.txt", "--workers", "2", "b/", "--out", "O"]]),
])
def test_flags_anywhere_parse_alike(parse, orders):
  parsed = [vars(parse(list(argv))) for argv in orders]
  assert all(p == parsed[0] for p in parsed), parsed
  if "overrides" in parsed[0]:
    assert parsed[0]["overrides"] == ["a=1", "b=2"]


def test_subcommands_keep_argparse_errors_and_help(capsys):
  parser = argparse.ArgumentParser(prog="cli")
  sub = parser.add_subparsers(dest="command", required=True)
  one = sub.add_parser("one")
  one.add_argument("overrides", nargs="*")
  one.add_argument("--flag", action="store_true")
  assert vars(parse_anywhere(parser, ["one", "x=1", "--flag", "y=2"], {"one": one})) == {
    "command": "one", "overrides": ["x=1", "y=2"], "flag": True}
  with pytest.raises(SystemExit) as e:
    parse_anywhere(parser, ["two"], {"one": one})
  assert e.value.code == 2 and "invalid choice: 'two'" in capsys.readouterr().err
  with pytest.raises(SystemExit) as e:
    parse_anywhere(parser, ["one", "--bad"], {"one": one})
  assert e.value.code == 2 and "unrecognized arguments: --bad" in capsys.readouterr().err
