"""A real S3-compatible server on localhost for the tests and the storage benchmark.

moto's server mode (``pip install 'moto[server]'``) runs as its own process on a free port,
the way s3fs's own test suite runs it: the client under test talks HTTP to it exactly as to
S3 or MinIO (signing, ranged GETs, multipart uploads, conditional puts). One thing is mended
in the server process (see :func:`_serve`): moto checks ``If-None-Match: *`` and then stores
the object as two steps on its request threads, so two creates racing for one key could both
succeed, where S3 lets exactly one win. :func:`s3_server` waits a bounded time for the port, yields the endpoint and
the environment a packtool subprocess needs, and always stops the server.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass

#: Fake credentials: moto accepts any; real stores never see these.
CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}


@dataclass(frozen=True)
class S3Server:
    endpoint: str
    env: dict[str, str]  # os.environ plus the endpoint and credentials, for subprocesses

    def client(self):
        """A boto3 client of this server (buckets are made with it)."""
        import boto3

        return boto3.client("s3", endpoint_url=self.endpoint, region_name="us-east-1",
                            aws_access_key_id="testing", aws_secret_access_key="testing")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_for_port(port: int, proc: subprocess.Popen, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"moto server exited with {proc.returncode} before listening")
        with socket.socket() as s:
            s.settimeout(0.2)
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.05)
    raise RuntimeError(f"moto server did not listen on port {port} within {timeout_s:.0f} s")


@contextlib.contextmanager
def server_process(args: list[str], timeout_s: float, names: tuple[str, ...]) -> Iterator[str]:
    """A test server as a process of its own: ``python ARGS`` (``{port}`` in them replaced by a
    free port), waited for a bounded time, ``http://127.0.0.1:PORT`` yielded, always stopped.
    The environment variables ``names`` are restored afterwards, and file systems packtool made
    inside the block are dropped (they name this endpoint)."""
    from packtool import storage

    port = free_port()
    proc = subprocess.Popen([sys.executable, *(a.format(port=port) for a in args)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    saved = {k: os.environ.get(k) for k in names}
    try:
        _wait_for_port(port, proc, timeout_s)
        storage._FILESYSTEMS.clear()  # file systems made before the endpoint was set
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
        storage._FILESYSTEMS.clear()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@contextlib.contextmanager
def s3_server(timeout_s: float = 30.0) -> Iterator[S3Server]:
    """Run moto's server (through :func:`_serve`) on a free localhost port for the duration of the block.

    The variables packtool reads (``AWS_ENDPOINT_URL``, credentials) are set in this process
    for the block and restored afterwards; ``server.env`` carries them to subprocesses.
    """
    with server_process([__file__, "-H", "127.0.0.1", "-p", "{port}"], timeout_s,
                        (*CREDENTIALS, "AWS_ENDPOINT_URL")) as endpoint:
        os.environ.update(CREDENTIALS, AWS_ENDPOINT_URL=endpoint)
        yield S3Server(endpoint, {**os.environ})


def upload_dir(client, local, bucket: str, prefix: str) -> int:
    """Copy every file under ``local`` to ``s3://bucket/prefix/...``; returns the file count."""
    from pathlib import Path

    n = 0
    for f in sorted(Path(local).rglob("*")):
        if f.is_file():
            client.upload_file(str(f), bucket, f"{prefix}/{f.relative_to(local).as_posix()}")
            n += 1
    return n


def _serve(argv: list[str]) -> None:
    """moto's server with conditional puts made atomic, as S3's are: a PUT carrying
    ``If-None-Match`` or ``If-Match`` checks and stores under one lock, so of several creates of
    one key exactly one succeeds (packtool's run lease and plan lock rely on that)."""
    import threading

    from moto.s3.responses import S3Response
    from moto.server import main

    lock = threading.Lock()
    put = S3Response.put_object

    def put_object(self):
        if self.headers.get("If-None-Match") is None and self.headers.get("If-Match") is None:
            return put(self)
        with lock:
            return put(self)

    S3Response.put_object = put_object
    main(argv)


if __name__ == "__main__":
    _serve(sys.argv[1:])
