"""jaxshare.files.write_atomic: what exists is one writer's whole file, and a failed write changes nothing."""

import threading

import pytest
from etils import epath

from jaxshare.files import write_atomic


def test_concurrent_writers_leave_one_whole_file_and_no_temporaries(tmp_path):
  path = tmp_path / "table.md"
  texts = [str(i) * 200_000 for i in range(8)]
  threads = [threading.Thread(target=write_atomic, args=(path, t)) for t in texts]
  for t in threads:
    t.start()
  for t in threads:
    t.join()
  assert path.read_text() in texts
  assert [p.name for p in tmp_path.iterdir()] == ["table.md"]


def test_a_failed_write_keeps_the_old_file_and_removes_its_temporary(tmp_path, monkeypatch):
  path = tmp_path / "config.yaml"
  write_atomic(path, b"old")

  def no_rename(self, target):
    raise OSError(28, "No space left on device")

  monkeypatch.setattr(type(epath.Path(path)), "replace", no_rename)
  with pytest.raises(OSError, match="No space"):
    write_atomic(path, "new")
  assert path.read_bytes() == b"old" and [p.name for p in tmp_path.iterdir()] == ["config.yaml"]
