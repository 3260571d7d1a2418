"""Data paths mean what the user typed (issue 43): a relative ``data.path`` that exists in the working directory is
read from there (the ``--out`` of a ``prepare`` run from that directory), one that does not is read from the data
directory (where ``tinyshakespeare.txt`` is); a missing path names every place tried; a path of the wrong kind names
the override that reads it."""

import pytest

from conftest import CORPUS
from jaxshare.config import DataConfig
from jaxshare.data import DataError, Datasets
from jaxshare.data.__main__ import main as data_main
from jaxshare.data.paths import resolve_path


def test_a_relative_path_is_read_from_the_working_directory_before_the_data_directory(tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)
  assert resolve_path(DataConfig()) == CORPUS.parent / "tinyshakespeare.txt"  # not here: the data directory's
  (tmp_path / "tinyshakespeare.txt").write_text("my own play")
  assert resolve_path(DataConfig()) == tmp_path / "tinyshakespeare.txt"


def test_prepare_then_train_on_the_relative_out_path_from_the_same_directory(tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)
  assert data_main(["prepare", "--out", "data/web", str(CORPUS), "--no-progress"]) == 0
  data = Datasets(DataConfig(source="prepared", path="data/web", seq_len=32), 8)
  assert data.components[0].stream.directory.resolve() == (tmp_path / "data" / "web").resolve()
  assert data.has_validation and len(data.train_source) > 1000


@pytest.mark.parametrize("source", ["text", "prepared"])
def test_a_missing_path_names_every_place_tried(tmp_path, monkeypatch, source):
  monkeypatch.chdir(tmp_path)
  cfg = DataConfig(source=source, path="data/web", data_dir=str(tmp_path / "shared"))
  with pytest.raises(DataError) as e:
    Datasets(cfg, 8)
  message = str(e.value)
  assert message.startswith("data.path='data/web': ") and "does not exist" in message
  assert f"'{tmp_path / 'data/web'}' nor '{tmp_path / 'shared/data/web'}'" in message
  assert "working directory, then in the data directory" in message


def test_a_path_of_the_wrong_kind_names_the_override_that_reads_it(tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)
  assert data_main(["prepare", "--out", "web", str(CORPUS), "--no-progress"]) == 0
  with pytest.raises(DataError, match=r"data.path='web': .* is a prepared directory .*: add data.source=prepared"):
    Datasets(DataConfig(source="text", path="web"), 8)
  (tmp_path / "books").mkdir()
  with pytest.raises(DataError, match=r"is a directory, not a text file: .*python -m jaxshare.data prepare"):
    Datasets(DataConfig(source="text", path="books"), 8)
  with pytest.raises(DataError, match=r"is a file, not a prepared directory: train on a text file with "
                                      r"data.source=text"):
    Datasets(DataConfig(source="prepared", path=str(CORPUS)), 8)


def test_mixture_paths_follow_the_same_rule(tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)
  assert data_main(["prepare", "--out", "play", str(CORPUS), "--no-progress"]) == 0
  cfg = DataConfig(source="prepared", seq_len=32, mixture=[{"path": "play", "weight": 1.0},
                                                           {"path": "nowhere", "weight": 1.0}])
  with pytest.raises(DataError, match=r"data.mixture\[1\].path='nowhere': the prepared directory does not exist"):
    Datasets(cfg, 8)
  ok = DataConfig(source="prepared", seq_len=32, mixture=[{"path": "play", "weight": 1.0, "name": "a"},
                                                          {"path": str(tmp_path / "play"), "weight": 1.0, "name": "b"}])
  assert [c.stream.directory.resolve() for c in Datasets(ok, 8).components] == [(tmp_path / "play").resolve()] * 2
