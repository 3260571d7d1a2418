"""jaxshare.files: what write_atomic leaves is one writer's whole file and a failed write changes nothing, locally
and on a bucket (a real GCS server: the gcs fixture); a directory that cannot be written is refused; a bucket's
outage is retried for the patience given, then reported in one line."""

import logging
import threading
import time

import pytest
from etils import epath

from jaxshare.exit_codes import InputError
from jaxshare.files import StorageUnavailable
from jaxshare.files import quiet_transient_tracebacks, with_retries, writable_dir, write_atomic


@pytest.mark.parametrize("where", ["local", "bucket"])
def test_concurrent_writers_leave_one_whole_file_and_no_temporaries(where, tmp_path, request):
  """On a bucket (a real GCS server: the gcs fixture) the objects are listed by the server itself: no copy, no
  temporary."""
  if where == "local":
    path, names = tmp_path / "table.md", lambda: [p.name for p in tmp_path.iterdir()]
  else:
    gcs = request.getfixturevalue("gcs")
    path, names = epath.Path("gs://runs/files/table.md"), lambda: [n.rpartition("/")[2] for n in gcs.objects(
      "runs", "files/")]
  texts = [str(i) * 200_000 for i in range(8)]
  threads = [threading.Thread(target=write_atomic, args=(path, t)) for t in texts]
  for t in threads:
    t.start()
  for t in threads:
    t.join()
  assert path.read_text() in texts
  assert names() == ["table.md"]


def test_a_failed_write_keeps_the_old_file_and_removes_its_temporary(tmp_path, monkeypatch):
  path = tmp_path / "config.yaml"
  write_atomic(path, b"old")

  def no_rename(self, target):
    raise OSError(28, "No space left on device")

  monkeypatch.setattr(type(epath.Path(path)), "replace", no_rename)
  with pytest.raises(OSError, match="No space"):
    write_atomic(path, "new")
  assert path.read_bytes() == b"old" and [p.name for p in tmp_path.iterdir()] == ["config.yaml"]


def test_a_bucket_that_does_not_exist_or_a_file_in_the_way_is_refused_naming_the_field(gcs, tmp_path):
  with pytest.raises(InputError, match=r"^train.run_dir=gs://no-such-bucket/r: cannot write there \(the bucket "
                     r"does not exist\)"):
    writable_dir("gs://no-such-bucket/r", "train.run_dir")
  (tmp_path / "file").write_text("")
  with pytest.raises(InputError, match=r"--out=.*file/sub: cannot write there .*file is not a writable directory"):
    writable_dir(tmp_path / "file" / "sub", "--out")
  assert writable_dir("gs://runs/new/run", "train.run_dir") == epath.Path("gs://runs/new/run")
  assert gcs.objects("runs", "new/") == []  # the probe is gone
  assert writable_dir(tmp_path / "a" / "b", "--out") == tmp_path / "a" / "b" and not (tmp_path / "a").exists()


def test_a_write_to_a_bucket_is_retried_through_an_outage(gcs):
  """(An outage longer than the patience: tests/e2e/test_gcs.py.)"""
  path = epath.Path("gs://runs/files/metrics.jsonl")
  tries = []

  def write():
    tries.append(time.monotonic())
    if len(tries) == 2:  # the server is back for the second try
      gcs.start()
    path.write_text("x")

  gcs.stop()
  try:
    with_retries(path, write, "metrics.jsonl", patience_s=600)
  finally:
    if gcs.proc is None:
      gcs.start()
  assert len(tries) == 2 and path.read_text() == "x"  # failed (after the client's own retries), then written


def test_a_local_write_is_never_retried(tmp_path):
  calls = []

  def fail():
    calls.append(1)
    raise OSError(28, "No space left on device")

  with pytest.raises(OSError, match="No space"):
    with_retries(tmp_path / "m.jsonl", fail, "metrics.jsonl", patience_s=600)
  assert calls == [1]


def test_a_transient_error_that_orbax_logs_as_an_argument_is_kept_off_the_console(caplog):
  """Orbax logs a failed read of a step's metadata at ERROR with the error as an argument, not as ``exc_info``
  (orbax/checkpoint/_src/metadata/checkpoint.py); during an outage that line followed the run's one-line report
  (tests/e2e/test_gcs.py), so it is kept off too. Errors that an outage does not explain still show."""
  from aiohttp import ClientConnectorError
  from aiohttp.client_reqrep import ConnectionKey

  key = ConnectionKey("127.0.0.1", 4443, False, True, None, None, None)
  refused = ClientConnectorError(key, ConnectionRefusedError(111, "Connect call failed"))
  quiet_transient_tracebacks()
  absl = logging.getLogger("absl")
  with caplog.at_level(logging.INFO):
    absl.error("Failed to read Metadata file: %s, error: %s", "gs://runs/c/8/_CHECKPOINT_METADATA", refused)
    absl.error("Failed to json parse Metadata file: %s, error: %s", "gs://runs/c/8/_CHECKPOINT_METADATA",
               ValueError("Expecting value"))
  assert [r.getMessage() for r in caplog.records] == [
    "Failed to json parse Metadata file: gs://runs/c/8/_CHECKPOINT_METADATA, error: Expecting value"]


def test_waiting_for_a_checkpoint_write_cut_by_an_outage_ends_after_the_patience(gcs):
  """The bucket went down while a checkpoint's arrays were being written: TensorStore retries for over 10 minutes,
  and a run stopping for the outage waited for it (tests/e2e/test_gcs.py timed out at 300 s); waiting is bounded by
  the patience. The write goes on in the background; with the bucket back it ends, committed or failed (the
  emulator forgets a resumable upload across a restart), and only a committed step is listed."""
  import jax.numpy as jnp

  from jaxshare.store.checkpoint import Checkpointer

  ckpt = Checkpointer("gs://runs/cut-write/checkpoints", keep=2)
  ckpt.save(1, {"w": jnp.ones((4096, 4096))}, None, {})  # 64 MiB: still being written when the server stops
  gcs.stop()
  try:
    t0 = time.monotonic()
    assert ckpt.wait(patience_s=2) is False
    assert time.monotonic() - t0 < 10
  finally:
    gcs.start()
  try:
    committed = ckpt.wait()
  except StorageUnavailable:
    committed = False
  assert ckpt.latest_step() == (1 if committed else None)


def test_a_write_whose_client_retries_past_the_patience_stops_after_the_patience(gcs):
  """TensorBoard's events go through google-cloud-storage, whose own retries last 120 s: with the server down, a run
  with 2 s of patience sat in them (tests/e2e/test_gcs.py timed out); the try is abandoned at the patience."""
  from google.cloud import storage

  blob = storage.Client().bucket("runs").blob("files/events")
  gcs.stop()
  try:
    t0 = time.monotonic()
    with pytest.raises(StorageUnavailable, match=r"events could not be written to gs://runs/files/events for 2 s"):
      with_retries(epath.Path("gs://runs/files/events"), lambda: blob.upload_from_string(b"x"), "events", 2.0)
    assert time.monotonic() - t0 < 10
  finally:
    gcs.start()


def test_a_checkpoint_write_cut_by_a_short_outage_is_written_again_by_the_next_save(gcs, monkeypatch):
  """A short outage cut a checkpoint's write: its upload session was gone when the server came back (seen in
  tests/e2e/test_gcs.py's short outage: FileNotFoundError on the resumable upload's URL), and the next save raised
  that failure, stopping the run (exit 4) where its other writes had ridden the outage out. The next save now writes
  its own step; the committed checkpoints are whole. (The cut itself cannot be timed here: the failure is raised as
  orbax raises a failed background save, from wait_until_finished, until a manager forgets it.)"""
  import jax.numpy as jnp

  from jaxshare.store.checkpoint import Checkpointer

  ckpt = Checkpointer("gs://runs/short-cut/checkpoints", keep=3)
  ckpt.save(1, {"w": jnp.ones((64, 64))}, None, {})
  assert ckpt.wait() is True
  lost = FileNotFoundError("http://127.0.0.1/upload/storage/v1/b/runs/o?uploadType=resumable&upload_id=x")

  def failed_save():
    raise lost

  monkeypatch.setattr(ckpt.manager, "wait_until_finished", failed_save)
  ckpt.save(2, {"w": jnp.full((64, 64), 2.0)}, None, {})
  assert ckpt.wait() is True
  assert ckpt.manager.all_steps() == [1, 2]
  monkeypatch.setattr(ckpt.manager, "wait_until_finished", lambda: (_ for _ in ()).throw(ValueError("a bug")))
  with pytest.raises(StorageUnavailable, match="ValueError: a bug"):  # not an outage: still stops the run
    ckpt.save(3, {"w": jnp.full((64, 64), 3.0)}, None, {})
