"""A real S3-compatible server on localhost for tests and benchmarks: moto in server mode.

It runs in its own process (``python -m moto.server``) and speaks HTTP like S3; skipinject reaches
it through s3fs exactly as it would reach AWS, configured by the standard environment variables.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def s3_environment(endpoint: str) -> dict[str, str]:
    """What a process needs to reach the server with s3fs/boto3 (no real credentials)."""
    return {
        "AWS_ACCESS_KEY_ID": "skipinject-test",
        "AWS_SECRET_ACCESS_KEY": "skipinject-test",
        "AWS_ENDPOINT_URL": endpoint,
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_EC2_METADATA_DISABLED": "true",
    }


@contextlib.contextmanager
def s3_server(log_path: str | None = None, timeout: float = 120.0) -> Iterator[str]:
    """Start moto's S3 server; yields its endpoint URL; stops it on exit."""
    port = _free_port()
    log = open(log_path or os.devnull, "wb")  # noqa: SIM115 - closed below
    process = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    endpoint = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"moto server exited with {process.returncode}")
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=1):
                break
            if time.monotonic() > deadline:
                raise RuntimeError("moto server did not start")
            time.sleep(0.1)
        yield endpoint
    finally:
        process.terminate()
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        log.close()


def use_server(endpoint: str, environ: Any) -> None:
    """Point this process's S3 clients at ``endpoint``: set the variables in ``environ`` (``os.environ``
    or a ``monkeypatch``) and drop s3fs's cached filesystems, which keep the endpoint they were made
    with (fsspec caches instances per class, by their arguments: not by the environment)."""
    for key, value in s3_environment(endpoint).items():
        if hasattr(environ, "setenv"):
            environ.setenv(key, value)
        else:
            environ[key] = value
    import s3fs

    s3fs.S3FileSystem.clear_instance_cache()


def create_bucket(endpoint: str, name: str) -> None:
    import boto3

    env = s3_environment(endpoint)
    client = boto3.client(
        "s3",
        endpoint_url=endpoint,
        aws_access_key_id=env["AWS_ACCESS_KEY_ID"],
        aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"],
        region_name=env["AWS_DEFAULT_REGION"],
    )
    client.create_bucket(Bucket=name)
