"""A GCS-compatible server on localhost for the gs:// tests: gcp-storage-emulator, a pure-Python
stub of the Google Cloud Storage JSON API (``pip install gcp-storage-emulator``).

It runs as its own process on a free port, like the S3 server of :mod:`bench.s3server`;
gcsfs reaches it through ``STORAGE_EMULATOR_HOST`` with anonymous credentials. One thing is
mended in the server process (see :func:`_serve`): the emulator ignores ``ifGenerationMatch``,
so a create (``ifGenerationMatch=0``, what gcsfs sends for ``mode="create"``) would overwrite
an existing object where GCS refuses it with 412. packtool's run lease and plan lock rely on
that refusal. The server answers one request at a time, so the check and the store cannot
interleave with another upload.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass

if __package__ in (None, ""):  # run as a script (the server process): bench/ is not a package there
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.s3server import server_process

#: What a packtool process needs to reach the emulator: its address and anonymous credentials
#: (gcsfs would otherwise look for Google credentials and a metadata server).
OPTIONS = {"token": "anon", "project": "test"}


@dataclass(frozen=True)
class GCSServer:
    endpoint: str
    env: dict[str, str]  # os.environ plus the emulator's address and options, for subprocesses

    def filesystem(self):
        """A gcsfs file system of this server, with its own caches (buckets are made with it)."""
        from gcsfs.core import (
            GCSFileSystem,  # not the class that asks a control plane the emulator lacks
        )

        return GCSFileSystem(endpoint_url=self.endpoint, skip_instance_cache=True, **OPTIONS)


@contextlib.contextmanager
def gcs_server(timeout_s: float = 30.0) -> Iterator[GCSServer]:
    """Run the emulator (through :func:`_serve`) on a free localhost port for the block.

    ``STORAGE_EMULATOR_HOST`` and ``PACKTOOL_STORAGE_OPTIONS`` are set in this process for the
    block and restored afterwards; ``server.env`` carries them to subprocesses.
    """
    from packtool import storage

    with server_process([os.path.abspath(__file__), "{port}"], timeout_s,
                        ("STORAGE_EMULATOR_HOST", storage.OPTIONS_ENV)) as endpoint:
        os.environ.update({"STORAGE_EMULATOR_HOST": endpoint, storage.OPTIONS_ENV: json.dumps(OPTIONS)})
        yield GCSServer(endpoint, {**os.environ})


def _serve(port: int) -> None:
    """The emulator, in memory, with ``ifGenerationMatch`` honoured on uploads as GCS does:
    ``0`` creates only an absent object, a generation number replaces only that generation;
    anything else gets ``412 Precondition Failed``."""
    from http import HTTPStatus

    from gcp_storage_emulator.exceptions import NotFound
    from gcp_storage_emulator.handlers import objects

    insert = objects.insert

    def conditional_insert(request, response, storage, *args, **kwargs):
        wanted = request.query.get("ifGenerationMatch")
        if wanted and request.query.get("uploadType", [""])[0] in ("media", "multipart"):
            name = request.query.get("name", [None])[0]
            if name is None and isinstance(request.data, dict):
                name = request.data.get("meta", {}).get("name")
            try:
                current = storage.get_file_obj(request.params["bucket_name"], name)["generation"]
            except NotFound:
                current = "0"
            if str(current) != wanted[0]:
                response.status = HTTPStatus.PRECONDITION_FAILED
                response.json({"error": {"code": 412, "message": "At least one of the pre-conditions you "
                                                                 "specified did not hold."}})
                return None
        return insert(request, response, storage, *args, **kwargs)

    objects.insert = conditional_insert  # before the server module builds its routes from it
    from gcp_storage_emulator.server import create_server

    create_server("127.0.0.1", port, in_memory=True).run()


if __name__ == "__main__":
    _serve(int(sys.argv[1]))
