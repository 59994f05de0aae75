"""Session-wide fixtures: a real local S3 server (moto), isolated roots, offline settings.

The S3 server is started lazily, once per session, only when a test asks for ``s3_url``.
Clients find it through ``AWS_ENDPOINT_URL`` (botocore reads it), the same way a user
points Relax at MinIO or any other S3-compatible store.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import urllib.request
import uuid
from pathlib import Path

import pytest

from tests.polling import wait_until

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
# engine servers the tests start guard their routes with it, and EngineClient sends it (relax.engines.guards)
os.environ.setdefault("RELAX_ENGINE_TOKEN", "relax-test-token")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

REPO = Path(__file__).resolve().parents[1]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_started(proc: subprocess.Popen, answers, name: str) -> None:
    """Wait (30 s at most) until the server ``proc`` answers (``answers()`` returns without OSError);
    kill it and raise if it exits or never does."""

    def started() -> bool:
        try:
            answers()
            return True
        except OSError:
            if proc.poll() is not None:
                raise RuntimeError(f"{name} did not start") from None
            return False

    try:
        wait_until(started, timeout=30, interval=0.2, what=f"{name} to start")
    except (AssertionError, RuntimeError):
        proc.kill()
        raise RuntimeError(f"{name} did not start") from None


@pytest.fixture(scope="session")
def moto_server():
    """A moto S3 server on a free loopback port; yields its endpoint URL, stops it at session end."""
    port = _free_port()
    exe = Path(sys.executable).with_name("moto_server")
    log = open(REPO / f".pytest_moto{os.environ.get('RELAX_TEST_GROUP', '')}.log", "wb")  # one per session
    proc = subprocess.Popen([str(exe), "-H", "127.0.0.1", "-p", str(port)], stdout=log, stderr=subprocess.STDOUT)
    endpoint = f"http://127.0.0.1:{port}"
    _wait_started(proc, lambda: urllib.request.urlopen(endpoint, timeout=1), f"moto_server (see {log.name})")
    saved = {k: os.environ.get(k) for k in ("AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")}
    os.environ.update(AWS_ENDPOINT_URL=endpoint, AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing")
    yield endpoint
    proc.terminate()
    proc.wait(timeout=10)
    log.close()
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


@pytest.fixture(scope="session")
def gcs_server():
    """A GCS emulator (gcp-storage-emulator, in memory) on a free loopback port; gcsfs finds it through
    ``STORAGE_EMULATOR_HOST``, as it finds a user's."""
    port = _free_port()
    exe = Path(sys.executable).with_name("gcp-storage-emulator")
    proc = subprocess.Popen([str(exe), "start", "--port", str(port), "-H", "127.0.0.1", "--in-memory", "-q"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    endpoint = f"http://127.0.0.1:{port}"
    _wait_started(proc, lambda: socket.create_connection(("127.0.0.1", port), timeout=1).close(),
                  "gcp-storage-emulator")
    saved = os.environ.get("STORAGE_EMULATOR_HOST")
    os.environ["STORAGE_EMULATOR_HOST"] = endpoint
    yield endpoint
    proc.terminate()
    proc.wait(timeout=10)
    if saved is None:
        os.environ.pop("STORAGE_EMULATOR_HOST", None)
    else:
        os.environ["STORAGE_EMULATOR_HOST"] = saved


@pytest.fixture
def gcs_url(gcs_server) -> str:
    """A fresh, empty bucket on the GCS emulator: ``gs://relax-test-<hex>``."""
    import fsspec

    bucket = f"relax-test-{uuid.uuid4().hex[:12]}"
    fsspec.filesystem("gs", token="anon").mkdir(bucket)
    return f"gs://{bucket}"


@pytest.fixture
def s3_url(moto_server) -> str:
    """A fresh, empty bucket for one test: ``s3://relax-test-<hex>``."""
    import fsspec

    bucket = f"relax-test-{uuid.uuid4().hex[:12]}"
    fsspec.filesystem("s3").mkdir(bucket)
    return f"s3://{bucket}"


@pytest.fixture(params=["file", "memory", "s3"])
def any_url(request, tmp_path) -> str:
    """The same test on a local folder, fsspec's in-memory store and the moto S3 server."""
    if request.param == "file":
        return f"file://{tmp_path}/store"
    if request.param == "memory":
        return f"memory://relax-{uuid.uuid4().hex[:12]}"
    request.applymarker(pytest.mark.s3)
    return request.getfixturevalue("s3_url")


@pytest.fixture(autouse=True, scope="session")
def _clean_flyte_tmp():
    """Local Flyte runs leave /tmp/flyte* folders behind; remove the ones this session made. The
    engine session of ``make test`` (infra/run_tests.py) runs no Flyte: the folders made while it ran
    are the other session's."""
    import glob
    import tempfile

    if os.environ.get("RELAX_TEST_GROUP") == "local":
        yield
        return
    pattern = os.path.join(tempfile.gettempdir(), "flyte*")
    before = set(glob.glob(pattern))
    yield
    for path in set(glob.glob(pattern)) - before:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="session")
def ray_session():
    """One local Ray cluster for the whole test session (Serve apps are deleted by their tests)."""
    import ray

    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False, ignore_reinit_error=True)
    yield ray
    from ray import serve

    serve.shutdown()
    ray.shutdown()
