"""Every path a URL: local paths as they are, ``s3://`` and ``gs://`` through fsspec.

A local path never comes here for its bytes: the stages keep using the operating system
directly, so local runs cost nothing more than before. A URL is handled by the ecosystem's
file-system layer (``s3fs`` for ``s3://`` with any S3-compatible endpoint, ``gcsfs`` for
``gs://``; install ``packtool[s3]`` or ``packtool[gcs]``) in four ways:

* **Inputs** (``tokenize`` corpora, ``pack``'s tokenized directory, the directories ``stats``,
  ``inspect`` and ``validate`` read): fetched once into a local cache, checked against the
  object's size and time (corpora) or the manifest's sha256 (shards), and read from there.
* **Media under a bucket ``--media-root``**: :class:`RemoteFile` objects that Pillow and PyAV
  read through :class:`RangedReader`, a file object doing ranged GETs that start small and grow
  only when a header needs more bytes, so a probe reads kilobytes of a megabyte image.
* **Outputs** (``-o s3://bucket/prefix``): ``publication.py``: shards are written locally,
  uploaded as whole objects, task markers after them, ``errors.jsonl`` and the manifest last;
  a lease object taken with a conditional put keeps two runs out of one prefix.
* **The reader**: ``PackedDataset("s3://...")`` streams row groups through ``reader/cache.py``.

Endpoint and credentials come from the usual environment (``AWS_ENDPOINT_URL``,
``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``, ``AWS_PROFILE``, ``GOOGLE_APPLICATION_CREDENTIALS``)
or from ``--storage-option key=value`` (fsspec's options for that file system, e.g.
``endpoint_url=http://minio:9000``); :func:`set_options` keeps them in the environment
variable ``PACKTOOL_STORAGE_OPTIONS`` so worker processes see them too.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import logging
import os
import posixpath
import re
import socket
import threading
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from .errors import ConfigError, InputError, PacktoolError, SampleError

__all__ = [
    "is_url",
    "split_url",
    "place",
    "join",
    "set_options",
    "storage_options",
    "forwarded_env",
    "with_env",
    "filesystem",
    "read_fresh",
    "StorageError",
    "storage_errors",
    "cache_dir",
    "RequestCounter",
    "RangedReader",
    "RemoteFile",
    "RemoteRoot",
    "as_root",
    "fetch_inputs",
    "fetch_listed",
    "input_stat",
    "is_listed",
    "input_copy",
    "source_name",
    "fetch_output",
    "fetch_manifest",
    "fetch_shard",
    "check_listed",
]

log = logging.getLogger(__name__)

#: URL schemes packtool reads and writes, with the fsspec package that serves each.
SCHEMES = {"s3": "s3fs", "s3a": "s3fs", "gs": "gcsfs", "gcs": "gcsfs"}
#: How a bucket URL starts (a media path in a record may be one).
BUCKET_URLS = tuple(f"{s}://" for s in SCHEMES)
_URL = re.compile(r"^(?P<scheme>[a-zA-Z][a-zA-Z0-9+.-]*)://(?P<rest>.*)$")
OPTIONS_ENV = "PACKTOOL_STORAGE_OPTIONS"
CACHE_ENV = "PACKTOOL_CACHE"


class StorageError(PacktoolError):
    """An object store refused or could not be reached; the message names the fix."""


def is_url(path: object) -> bool:
    """Whether ``path`` is an object-store URL (``s3://...``, ``gs://...``) rather than a local path.

    ``file://`` URLs are local paths. An unknown scheme is refused, so a typo never becomes a
    local directory named ``s4:``.

    Example:
        >>> is_url("s3://bucket/tok"), is_url("tok"), is_url(Path("s3/x"))
        (True, False, False)
    """
    if not isinstance(path, str):
        return False
    m = _URL.match(path)
    if m is None or m["scheme"].lower() == "file":
        return False
    if m["scheme"].lower() not in SCHEMES:
        raise ConfigError(f"{path!r}: packtool reads and writes local paths, {', '.join(s + '://' for s in SCHEMES)} "
                          "URLs; use one of those")
    return True


def split_url(url: str) -> tuple[str, str, str]:
    """``(scheme, bucket, key)`` of an object-store URL; the key has no trailing slash.

    Example:
        >>> split_url("s3://data/corpus/tok/")
        ('s3', 'data', 'corpus/tok')
    """
    m = _URL.match(url)
    if m is None:
        raise ConfigError(f"{url!r} is not a URL")
    scheme = m["scheme"].lower()
    bucket, _, key = m["rest"].partition("/")
    if not bucket:
        raise ConfigError(f"{url!r} names no bucket; write {scheme}://BUCKET/PREFIX")
    return scheme, bucket, key.strip("/")


def place(url: str) -> tuple[str, str, str]:
    """``(protocol, bucket, key)``: the objects a URL addresses, however it is spelled (the
    ``s3a://`` / ``gcs://`` aliases, a capital scheme, a trailing slash), as :func:`filesystem` reaches them.

    Example:
        >>> place("S3A://data/tok/") == place("s3://data/tok")
        True
    """
    scheme, bucket, key = split_url(url)
    return {"s3a": "s3", "gcs": "gs"}.get(scheme, scheme), bucket, key


def join(base: str | Path, *parts: str) -> str | Path:
    """``base / part / ...`` for a local path or a URL (a URL stays a string)."""
    if is_url(base):
        return "/".join([str(base).rstrip("/"), *(p.strip("/") for p in parts)])
    return Path(base).joinpath(*parts)


def _local_or_url(path: str | Path) -> str | Path:
    return str(path) if is_url(str(path)) else Path(path)


# --------------------------------------------------------------------------- options and file systems


def _option_value(text: str):
    """A ``--storage-option`` value: JSON when it parses (``true``, ``3``, ``{"a": 1}``), else the text."""
    try:
        return json.loads(text)
    except ValueError:
        return text


def set_options(pairs: list[str]) -> dict:
    """Parse ``key=value`` pairs (``--storage-option``) into fsspec options and make them current.

    A dotted key sets a nested option: ``client_kwargs.region_name=eu-west-1``. The options are
    kept in ``PACKTOOL_STORAGE_OPTIONS`` (JSON), so pool workers and subprocesses use them too.

    Example:
        >>> set_options(["endpoint_url=http://127.0.0.1:9000", "client_kwargs.region_name=us-east-1"])
        {'endpoint_url': 'http://127.0.0.1:9000', 'client_kwargs': {'region_name': 'us-east-1'}}
    """
    options: dict = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"--storage-option {pair!r}: write KEY=VALUE, e.g. endpoint_url=http://127.0.0.1:9000")
        *path, leaf = key.strip().split(".")
        node = options
        for part in path:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"--storage-option {pair!r}: {part!r} is set twice, once as a value")
        node[leaf] = _option_value(value)
    if options:
        os.environ[OPTIONS_ENV] = json.dumps(options)
    else:
        os.environ.pop(OPTIONS_ENV, None)
    _FILESYSTEMS.clear()
    return options


def storage_options() -> dict:
    """The options every file system is made with (``PACKTOOL_STORAGE_OPTIONS``, JSON)."""
    text = os.environ.get(OPTIONS_ENV)
    if not text:
        return {}
    try:
        options = json.loads(text)
    except ValueError:
        options = None
    if not isinstance(options, dict):
        raise ConfigError(f"{OPTIONS_ENV} is not a JSON object; unset it or use --storage-option KEY=VALUE")
    return options


#: What a task on another machine needs of the driver's environment to reach the same store:
#: ``--storage-option`` values and the endpoint, credentials and region variables. Variables
#: naming a file on the driver's machine (``AWS_PROFILE``, ``AWS_SHARED_CREDENTIALS_FILE``,
#: ``GOOGLE_APPLICATION_CREDENTIALS``) are not carried: that file is not on the other machine.
FORWARDED_ENV = (OPTIONS_ENV, "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY",
                 "AWS_SESSION_TOKEN", "AWS_DEFAULT_REGION", "AWS_REGION")


def forwarded_env() -> dict[str, str]:
    """The driver's :data:`FORWARDED_ENV` variables that are set, for tasks on other machines.

    A Ray worker on another node starts from its own node's environment, not the driver's;
    :func:`with_env` applies these there. They travel inside the task's arguments, never in a
    Ray ``runtime_env`` (which the cluster's dashboard and job listing show in clear).
    """
    return {k: os.environ[k] for k in FORWARDED_ENV if os.environ.get(k)}


@contextlib.contextmanager
def with_env(env: dict[str, str]) -> Iterator[None]:
    """Run the block with ``env`` set (a task from another machine's driver), then restore.

    The file systems made in this process are dropped whenever the variables change, so no
    task reaches a store with another run's endpoint or credentials.
    """
    saved = {k: os.environ.get(k) for k in env}
    changed = any(saved[k] != v for k, v in env.items())
    if changed:
        os.environ.update(env)
        _FILESYSTEMS.clear()
    try:
        yield
    finally:
        if changed:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
            _FILESYSTEMS.clear()


_FILESYSTEMS: dict = {}


def filesystem(url: str):
    """``(fs, path)``: the fsspec file system serving ``url`` (one per scheme and process) and its path there."""
    scheme, bucket, key = split_url(url)
    protocol = {"s3a": "s3", "gcs": "gs"}.get(scheme, scheme)
    fs = _FILESYSTEMS.get((protocol, os.getpid()))
    if fs is None:
        package = SCHEMES[scheme]
        try:
            __import__(package)
        except ImportError:
            extra = "s3" if protocol == "s3" else "gcs"
            raise ConfigError(f"{url!r} needs the {package} package; pip install 'packtool[{extra}]'") from None
        import fsspec

        options = dict(storage_options())
        if protocol == "s3" and "endpoint_url" not in options and os.environ.get("AWS_ENDPOINT_URL"):
            # botocore reads it too; passing it keeps older botocore releases on the same endpoint
            options["endpoint_url"] = os.environ["AWS_ENDPOINT_URL"]
        if protocol == "gs":
            _check_gcs_key_file(options.get("token"))
        try:
            if protocol == "gs" and os.environ.get("STORAGE_EMULATOR_HOST"):
                # an emulator serves the JSON API only; gcsfs's default class first asks the gRPC
                # control plane for each bucket's layout and waits a minute for an answer
                from gcsfs.core import GCSFileSystem

                fs = GCSFileSystem(skip_instance_cache=True, **options)
            else:
                fs = fsspec.filesystem(protocol, skip_instance_cache=True, **options)
        except TypeError as exc:
            raise ConfigError(f"--storage-option: {exc}; see the {package} documentation for its options") from None
        _FILESYSTEMS[(protocol, os.getpid())] = fs
    return fs, f"{bucket}/{key}" if key else bucket


def _check_gcs_key_file(token: object) -> None:
    """Refuse a GCS key file that is not there before gcsfs sees it: gcsfs takes a ``token``
    that names no file for a raw access token and asks Google to check it (a traceback, offline
    or online), and skips a missing ``GOOGLE_APPLICATION_CREDENTIALS`` for anonymous access."""
    if isinstance(token, str) and (token.endswith(".json") or "/" in token or os.sep in token) \
            and not os.path.isfile(token):
        raise ConfigError(f"--storage-option token={token!r}: no such file; pass the path of a service-account key "
                          "file (JSON), or token=anon for public buckets")
    key = os.environ.get("GOOGLE_APPLICATION_CREDENTIALS")
    if token is None and key and not os.path.isfile(key):
        raise ConfigError(f"GOOGLE_APPLICATION_CREDENTIALS={key!r}: no such file; point it at a service-account key "
                          "file (JSON), or unset it")


def _fix_for(scheme: str) -> str:
    if scheme.startswith("s3"):
        return ("set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or AWS_PROFILE), or pass --storage-option key=... "
                "--storage-option secret=...")
    return "set GOOGLE_APPLICATION_CREDENTIALS, or pass --storage-option token=PATH_TO_KEY.json"


def storage_error(exc: BaseException, url: str, writing: bool = False) -> PacktoolError:
    """The one-line ``Error:`` for what an object store answered while reading or writing ``url``.

    Example:
        A ``NoCredentialsError`` reading ``s3://b/tok`` gives ``StorageError("no credentials for
        's3://b/tok'; set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY ...")``.
    """
    scheme, bucket, _ = split_url(url)
    name = type(exc).__name__
    text = str(exc)
    flag = "-o" if writing else "the input path"
    if name == "ProfileNotFound":
        profile = getattr(exc, "kwargs", {}).get("profile") or os.environ.get("AWS_PROFILE")
        return StorageError(f"AWS profile {profile!r} (AWS_PROFILE or --storage-option profile=...) is not defined in "
                            "~/.aws/config or ~/.aws/credentials (AWS_CONFIG_FILE, AWS_SHARED_CREDENTIALS_FILE); name "
                            f"a profile defined there, or unset it and {_fix_for(scheme).replace(' (or AWS_PROFILE)', '')}")
    if name in ("NoCredentialsError", "PartialCredentialsError", "DefaultCredentialsError") \
            or "credentials" in text.lower() and "invalid" not in text.lower():
        return StorageError(f"no credentials for {url!r}; {_fix_for(scheme)}")
    if name in ("EndpointConnectionError", "ConnectTimeoutError", "ClientConnectorError", "ConnectionError") \
            or isinstance(exc, ConnectionError) or "Could not connect" in text:
        variable = "AWS_ENDPOINT_URL" if scheme.startswith("s3") else "STORAGE_EMULATOR_HOST"
        where = storage_options().get("endpoint_url") or os.environ.get(variable) or "the default endpoint"
        return StorageError(f"cannot reach the object store for {url!r} at {where} ({text[:200]}); check the endpoint "
                            f"({variable} or --storage-option endpoint_url=...) and the network")
    if "NoSuchBucket" in text or "bucket does not exist" in text.lower() \
            or isinstance(exc, FileNotFoundError) and not _bucket_exists(url):
        return StorageError(f"bucket {bucket!r} does not exist ({url!r}); create it or fix {flag}")
    if isinstance(exc, PermissionError) or "AccessDenied" in text or "Forbidden" in text or "403" in text:
        what = "write to" if writing else "read"
        return StorageError(f"access denied to {what} {url!r} ({text[:200]}); grant the credentials "
                            f"{'s3:PutObject, s3:DeleteObject and s3:ListBucket' if writing else 's3:GetObject and s3:ListBucket'} "
                            f"on {bucket!r}, or use other credentials ({_fix_for(scheme)})")
    if isinstance(exc, FileNotFoundError):
        return InputError(f"{url!r} does not exist; fix {flag}")
    return StorageError(f"object store error on {url!r}: {name}: {text[:300]}; fix the cause and run the same "
                        "command again (finished tasks are kept)")


def read_fresh(fs, path: str) -> bytes:
    """The object at ``path`` as the store holds it now, whatever this process listed before.

    fsspec's object-store file systems keep the listings they made (s3fs, gcsfs), and s3fs
    answers a read of a key that a cached listing of its folder lacks with ``FileNotFoundError``
    without asking the store (``cat_file`` looks the size up first). An object another
    process or machine wrote after that listing, a rank's plan lock or plan, would then look
    absent; so the cached listings of the key and its folders are dropped before the read. A
    missing object still raises ``FileNotFoundError``.
    """
    fs.invalidate_cache(path)
    return fs.cat_file(path)


def _missing_bucket(url: str) -> None:
    """Raise the missing-bucket error when ``url``'s bucket does not exist (a not-found key there is that)."""
    if not _bucket_exists(url):
        raise StorageError(f"bucket {split_url(url)[1]!r} does not exist ({url!r}); create it or fix the path")


def _bucket_exists(url: str) -> bool:
    try:
        fs, path = filesystem(url)
        return bool(fs.exists(path.split("/", 1)[0]))
    except Exception:  # noqa: BLE001 - asked only to word an error; unknown counts as existing
        return True


@contextlib.contextmanager
def storage_errors(url: str, writing: bool = False) -> Iterator[None]:
    """Turn what the store or its client raises into :func:`storage_error` (``PacktoolError`` passes)."""
    try:
        yield
    except (PacktoolError, SampleError, KeyboardInterrupt):
        raise
    except Exception as exc:  # noqa: BLE001 - botocore, aiohttp and google errors share no base class
        if not _is_store_error(exc):
            raise
        raise storage_error(exc, url, writing) from exc


def _is_store_error(exc: BaseException) -> bool:
    if isinstance(exc, OSError | ConnectionError | TimeoutError):
        return True
    module = type(exc).__module__ or ""
    return module.split(".")[0] in ("botocore", "aiobotocore", "aiohttp", "google", "gcsfs", "s3fs", "urllib3")


def cache_dir() -> Path:
    """Where fetched inputs, staged outputs and the reader's row groups live (``PACKTOOL_CACHE``,
    default ``$XDG_CACHE_HOME/packtool``, else ``~/.cache/packtool``)."""
    base = os.environ.get(CACHE_ENV) or os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"),
                                                     "packtool")
    path = Path(base)
    path.mkdir(parents=True, exist_ok=True)
    return path


def _url_key(url: str) -> str:
    return hashlib.sha256(url.rstrip("/").encode()).hexdigest()[:16]


_HOST = socket.gethostname().replace("/", "_") or "localhost"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


# --------------------------------------------------------------------------- ranged reads (media)


class RequestCounter:
    """Requests and bytes read from object stores by this process (the storage benchmark reads it)."""

    requests = 0
    bytes = 0
    _lock = threading.Lock()

    @classmethod
    def add(cls, n_bytes: int) -> None:
        with cls._lock:
            cls.requests += 1
            cls.bytes += n_bytes

    @classmethod
    def reset(cls) -> tuple[int, int]:
        with cls._lock:
            out = (cls.requests, cls.bytes)
            cls.requests = cls.bytes = 0
        return out


#: The first read of a remote media file: enough for the headers of nearly every JPEG, PNG and WebP.
HEAD_BYTES = 16 << 10
#: The tail a truncation check reads (``media._TAIL``).
TAIL_BYTES = 4 << 10


class RangedReader(io.RawIOBase):
    """A seekable, read-only file object over one object, read by ranged GETs.

    Reads are served from the ranges already fetched; a miss fetches from the read position a
    block that starts at ``first_block`` bytes and doubles with each further miss past the
    previous block's end (a header that needs more grows the read, a probe that needs 2 KiB
    costs one small request). Reads near the end of the object (a tail check) fetch only what
    they ask for. PyAV and Pillow read it like a file.

    Of what it fetched itself it keeps the latest :attr:`max_held` bytes (and at least the
    last block): a video demuxed to count its frames is read whole, once, front to back.

    Example:
        A 3 MB JPEG probed for its size and its end-of-image marker costs two GETs: 16 KiB
        from the start, 4 KiB from the end.
    """

    #: Bytes of its own fetches a reader keeps for reads that come back to them.
    max_held = 32 << 20

    def __init__(self, fs, path: str, size: int, first_block: int = HEAD_BYTES, max_block: int = 8 << 20,
                 ranges: list[tuple[int, bytes]] | None = None) -> None:
        super().__init__()
        self.fs, self.path, self.size = fs, path, size
        self.pos = 0
        self.block = first_block
        self.max_block = max_block
        # (start, data), few per file; shared with the RemoteFile, so what a prefetch read is used
        self._ranges: list[tuple[int, bytes]] = ranges if ranges is not None else []
        self._own: list[tuple[int, bytes]] = []  # what this reader fetched, oldest first
        self._own_bytes = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self.pos, io.SEEK_END: self.size}[whence]
        self.pos = max(0, base + offset)
        return self.pos

    def _cached(self, start: int, n: int) -> bytes | None:
        for begin, data in self._ranges:
            if begin <= start and start + n <= begin + len(data):
                return data[start - begin:start - begin + n]
        return None

    def _fetch(self, start: int, end: int) -> bytes:
        data = self.fs.cat_file(self.path, start=start, end=end)
        RequestCounter.add(len(data))
        entry = (start, data)
        self._ranges.append(entry)
        self._own.append(entry)
        self._own_bytes += len(data)
        # a demux reads the whole file: holding every block would hold the whole file in memory
        while self._own_bytes > self.max_held and len(self._own) > 1:
            old = self._own.pop(0)
            self._own_bytes -= len(old[1])
            for i, kept in enumerate(self._ranges):
                if kept is old:
                    del self._ranges[i]
                    break
        return data

    def read(self, n: int = -1) -> bytes:
        if self.pos >= self.size:
            return b""
        if n is None or n < 0:
            n = self.size - self.pos
        n = min(n, self.size - self.pos)
        hit = self._cached(self.pos, n)
        if hit is None:
            end = min(self.size, self.pos + max(n, self.block))
            if self.pos > self.size // 2 and self.size - self.pos <= max(n, 64 << 10):
                end = min(self.size, self.pos + n)  # a tail read: exactly what is asked
            else:
                self.block = min(self.block * 2, self.max_block)
            data = self._fetch(self.pos, end)
            hit = data[:n]
        self.pos += len(hit)
        return hit

    def readinto(self, b) -> int:
        data = self.read(len(b))
        b[:len(data)] = data
        return len(data)


@dataclass(frozen=True)
class _Stat:
    st_size: int
    st_mtime_ns: int


class RemoteFile:
    """One media object under a bucket ``--media-root``: the slice of ``Path`` media code uses
    (``stat``, ``open``, ``read_bytes``, ``name``), backed by ranged reads."""

    def __init__(self, url: str, info: dict | None = None) -> None:
        self.url = url
        self._info = info
        self.ranges: list[tuple[int, bytes]] = []  # bytes already fetched: (start, data)

    def __str__(self) -> str:
        return self.url

    def __repr__(self) -> str:
        return f"RemoteFile({self.url!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, RemoteFile) and other.url == self.url

    def __hash__(self) -> int:
        return hash(self.url)

    @property
    def name(self) -> str:
        return posixpath.basename(self.url)

    def info(self) -> dict:
        if self._info is None:
            fs, path = filesystem(self.url)
            with storage_errors(self.url):
                self._info = fs.info(path)
            RequestCounter.add(0)
        return self._info

    def stat(self) -> _Stat:
        info = self.info()
        return _Stat(int(info["size"]), _mtime_ns(info))

    def open(self, mode: str = "rb") -> RangedReader:
        if mode != "rb":
            raise RuntimeError(f"internal error: remote media opened with mode {mode!r}")
        fs, path = filesystem(self.url)
        return RangedReader(fs, path, self.stat().st_size, ranges=self.ranges)

    def read_bytes(self) -> bytes:
        size = self.stat().st_size
        for start, data in self.ranges:
            if start == 0 and len(data) == size:
                return data
        fs, path = filesystem(self.url)
        with storage_errors(self.url):
            data = fs.cat_file(path)
        RequestCounter.add(len(data))
        return data

    def fetch(self, whole: bool) -> RemoteFile:
        """Read ahead what a probe will read (the head block and the tail) or, ``whole``, every byte."""
        fs, path = filesystem(self.url)
        size = self.stat().st_size
        spans = [(0, size)] if whole or size <= HEAD_BYTES + TAIL_BYTES else \
            [(0, HEAD_BYTES), (size - TAIL_BYTES, size)]
        for lo, hi in spans:
            data = fs.cat_file(path, start=lo, end=hi)
            RequestCounter.add(len(data))
            self.ranges.append((lo, data))
        return self


def _mtime_ns(info: dict) -> int:
    """An object's modification time in ns (``LastModified`` on S3, ``updated`` on GCS)."""
    value = info.get("LastModified") or info.get("mtime") or info.get("updated") or info.get("last_modified")
    if value is None:
        return 0
    if isinstance(value, int | float):
        return int(value * 1e9)
    if isinstance(value, str):
        from datetime import datetime

        value = datetime.fromisoformat(value.replace("Z", "+00:00"))
    return int(value.timestamp() * 1_000_000) * 1000


class RemoteRoot:
    """A ``--media-root`` in a bucket: media paths of records resolve to :class:`RemoteFile` under it.

    A relative path is a key under the root (``..`` that leaves it is ``path_outside_root``); an
    absolute URL in a record is accepted when it lies under the root. One listing per directory
    answers existence and size for every file in it, so a probe costs no HEAD request.
    """

    def __init__(self, url: str) -> None:
        self.url = url.rstrip("/")
        self.scheme, self.bucket, self.key = split_url(self.url)
        self._dirs: OrderedDict[str, dict[str, dict]] = OrderedDict()
        self._ready: dict[str, RemoteFile] = {}  # prefetched heads and tails, handed out once
        self._chunk: dict[str, RemoteFile] = {}  # whole files of the chunk being embedded
        self._seen: OrderedDict[str, None] = OrderedDict()
        self._lock = threading.Lock()

    def __str__(self) -> str:
        return self.url

    def __fspath__(self) -> str:  # pragma: no cover - a bug if reached: remote roots have no local path
        raise RuntimeError(f"internal error: {self.url!r} used as a local path")

    def __eq__(self, other: object) -> bool:
        return isinstance(other, RemoteRoot) and other.url == self.url

    def __hash__(self) -> int:
        return hash(self.url)

    def resolve(self) -> RemoteRoot:
        return self

    def is_dir(self) -> bool:
        fs, path = filesystem(self.url)
        with storage_errors(self.url):
            found = bool(fs.isdir(path))
        if not found:
            _missing_bucket(self.url)
        return found

    def _listing(self, directory: str) -> dict[str, dict]:
        with self._lock:
            entries = self._dirs.get(directory)
        if entries is None:
            fs, _ = filesystem(self.url)
            try:
                with storage_errors(self.url):
                    listed = fs.ls(directory, detail=True, refresh=True)  # this cache is ours, not fsspec's
                RequestCounter.add(0)
            except (FileNotFoundError, InputError):
                listed = []
            entries = {posixpath.basename(e["name"].rstrip("/")): e for e in listed if e.get("type") == "file"}
            with self._lock:
                if len(self._dirs) >= 4096:
                    self._dirs.popitem(last=False)
                self._dirs[directory] = entries
        return entries

    def prefetch(self, paths: list[str], whole: bool = False, threads: int = 16, max_bytes: int = 256 << 20) -> None:
        """Fetch ahead, ``threads`` at a time, what the next probes (head and tail) or, ``whole``,
        the next embeds will read of ``paths``, so a batch costs one round trip per thread
        instead of one per file. Paths probed before, or that do not resolve, are skipped (the
        sequential path reports them); :meth:`file` hands each prefetched head out once. Whole
        files are kept until the next whole prefetch (a chunk of packs may embed one file many
        times) and stop at ``max_bytes`` in all (the rest are read when used).
        """
        from concurrent.futures import ThreadPoolExecutor

        todo = []
        with self._lock:
            if whole:
                self._chunk = {}
            for p in dict.fromkeys(paths):
                if not whole:
                    if p in self._ready or p in self._seen:
                        continue
                    self._seen[p] = None
                    if len(self._seen) > 1 << 20:
                        self._seen.popitem(last=False)
                todo.append(p)
        files = {}
        budget = max_bytes
        for p in todo:  # one listing per directory answers these; the requests below go in parallel
            with contextlib.suppress(SampleError):
                f = self._resolve(p)
                budget -= f.stat().st_size if whole else HEAD_BYTES + TAIL_BYTES
                if budget < 0:
                    break
                files[p] = f
        if not files:
            return
        with self._lock:
            if len(self._ready) > 1 << 16:  # handed out to nobody (rows rejected before use): let go
                self._ready.clear()

        def one(path: str) -> None:
            try:
                f = files[path].fetch(whole)
            except Exception:  # noqa: BLE001 - the probe or embed that needs it raises the real error
                return
            with self._lock:
                (self._chunk if whole else self._ready)[path] = f

        with ThreadPoolExecutor(min(threads, len(files)), thread_name_prefix="packtool-media") as pool:
            list(pool.map(one, files))

    def file(self, path: str) -> RemoteFile:
        """The media object ``path`` names (relative to the root, or a URL under it)."""
        with self._lock:
            ready = self._ready.pop(path, None) or self._chunk.get(path)
        return ready if ready is not None else self._resolve(path)

    def _resolve(self, path: str) -> RemoteFile:
        shown = path if len(path) <= 200 else f"{path[:200]}..."
        if "\x00" in path:
            raise SampleError("bad_record", f"media path {shown!r} holds a NUL byte, which no file name can")
        if _URL.match(path):
            scheme, bucket, key = split_url(path)
            if {"s3a": "s3", "gcs": "gs"}.get(scheme, scheme) != {"s3a": "s3", "gcs": "gs"}.get(self.scheme, self.scheme) \
                    or bucket != self.bucket:
                raise SampleError("path_outside_root", f"media URL {shown!r} is outside --media-root {self.url!r}")
        elif path.startswith("/"):
            raise SampleError("path_outside_root", f"media path {shown!r} is a local absolute path; --media-root "
                                                   f"{self.url!r} is a bucket: give paths relative to it")
        else:
            key = posixpath.join(self.key, path) if self.key else path
        key = posixpath.normpath(key) if key else key
        if key.startswith("..") or (self.key and key != self.key and not key.startswith(self.key + "/")):
            raise SampleError("path_outside_root", f"media path {shown!r} resolves outside --media-root {self.url!r}")
        directory, name = posixpath.split(key)
        entry = self._listing(f"{self.bucket}/{directory}" if directory else self.bucket).get(name)
        if entry is None:
            raise SampleError("missing_media", f"media file {shown!r} not found under --media-root {self.url!r}")
        return RemoteFile(f"{self.scheme}://{self.bucket}/{key}", entry)


def as_root(root: str | Path) -> Path | RemoteRoot:
    """The media root of a config: a local ``Path``, or a :class:`RemoteRoot` for a URL."""
    return RemoteRoot(str(root)) if is_url(str(root)) else Path(root)


# --------------------------------------------------------------------------- inputs


def _inputs_cache() -> Path:
    return cache_dir() / "inputs"


def _cached_name(url: str) -> Path:
    scheme, bucket, key = split_url(url)
    return _inputs_cache() / scheme / bucket / key


#: Local copies of finished outputs fetched by this process -> their URLs.
_FETCHED: dict[str, str] = {}


def source_name(path: str | Path) -> str:
    """The name a path is recorded and shown by: the URL of a fetched input (a row's ``source``)
    or of a fetched output (what ``stats`` reports), else the path as given.

    Example:
        ``~/.cache/packtool/inputs/s3/data/corpus/a.jsonl`` -> ``s3://data/corpus/a.jsonl``
    """
    text = str(path)
    if text in _FETCHED:
        return _FETCHED[text]
    base = str(_inputs_cache()) + os.sep
    if text.startswith(base):
        scheme, _, rest = text[len(base):].partition(os.sep)
        return f"{scheme}://{rest.replace(os.sep, '/')}"
    return text


#: Inputs listed but maybe not fetched: where the local copy goes -> (URL, the listing's entry).
_LISTED: dict[str, tuple[str, dict]] = {}


def fetch_inputs(inputs: list[str | Path], fetch: bool = True) -> list[str | Path]:
    """Local copies of the input files under URLs (a URL naming a prefix brings every file under it).

    A copy is fetched once and kept while the object's size and time stay the same; its
    modification time is set to the object's, so a resumed run sees unchanged inputs. Local
    inputs pass through unchanged. Rows keep the URL as their ``source`` (:func:`source_name`).
    ``fetch=False`` lists the objects and returns where their copies go without fetching them:
    :func:`input_stat` answers from the listing, :func:`fetch_listed` fetches them when a
    process needs their bytes (the one that plans the run, or a rank for its own tasks).
    """
    from .formats import SUFFIXES, is_input_name

    out: list[str | Path] = []
    for item in inputs:
        text = str(item)
        if not is_url(text):
            out.append(item)
            continue
        fs, path = filesystem(text)
        scheme, bucket, _ = split_url(text)
        with storage_errors(text):
            if fs.isdir(path):
                found = fs.find(path, detail=True)
                outputs = _output_prefixes(found)
                if path in outputs:
                    raise InputError(f"input {text!r} is a packtool output directory, not raw records; pass the corpus "
                                     "it was made from (pack takes a tokenized directory)")
                # as under a local directory: hidden entries and packtool outputs are not inputs
                entries = [e for k, e in sorted(found.items()) if e.get("type") == "file"
                           and not any(part.startswith(".") for part in k[len(path):].split("/"))
                           and is_input_name(k) and not any(k.startswith(d + "/") for d in outputs)]
                if not entries:
                    raise InputError(f"no input files found under {text!r}; expected {', '.join(SUFFIXES)}")
            elif fs.exists(path):
                entries = [fs.info(path)]
            else:
                _missing_bucket(text)
                raise InputError(f"input {text!r} does not exist")
            for e in entries:
                url = f"{scheme}://{e['name']}"
                _LISTED[str(_cached_name(url))] = (url, e)
                out.append(_get_input(fs, url, e) if fetch else _cached_name(url))
    return out


def _output_prefixes(keys) -> set[str]:
    """The prefixes among listed ``keys`` that hold a packtool output (finished or not): what
    ``shards.is_output_dir`` says of a local directory."""
    from .shards import LEGACY_MANIFEST, MANIFEST, RUN_STATE, STATE_DIR

    marks = (f"/{STATE_DIR}/{RUN_STATE}", f"/{MANIFEST}", f"/{LEGACY_MANIFEST}")
    return {k[:-len(m)] for k in keys for m in marks if k.endswith(m)}


def is_listed(path: str | Path) -> bool:
    """Whether ``path`` is where a listed input's copy goes (see :func:`fetch_inputs`)."""
    return str(path) in _LISTED


def input_stat(path: str | Path) -> tuple[int, int]:
    """``(size, mtime_ns)`` of an input: a listed object's from its listing, a local file's from ``stat``."""
    listed = _LISTED.get(str(path))
    if listed is not None:
        return int(listed[1]["size"]), _mtime_ns(listed[1])
    st = os.stat(path)
    return st.st_size, st.st_mtime_ns


def fetch_listed(paths) -> None:
    """Fetch the listed inputs among ``paths`` that are not cached yet (each once)."""
    for path in dict.fromkeys(str(p) for p in paths):
        listed = _LISTED.get(path)
        if listed is not None:
            fs, _ = filesystem(listed[0])
            with storage_errors(listed[0]):
                _get_input(fs, *listed)


def _get_input(fs, url: str, info: dict) -> Path:
    """The cached copy of input ``url``, fetched unless it is there with the object's size and time."""
    local = _cached_name(url)
    mtime = _mtime_ns(info)
    if not (local.is_file() and local.stat().st_size == info["size"] and local.stat().st_mtime_ns == mtime):
        local.parent.mkdir(parents=True, exist_ok=True)
        tmp = local.with_name(f".{local.name}.{os.getpid()}.tmp")
        fs.get_file(info["name"], str(tmp))
        RequestCounter.add(int(info["size"]))
        os.utime(tmp, ns=(mtime, mtime))
        os.replace(tmp, local)
    return local


def input_copy(path: str) -> str:
    """``path`` itself, or for a fetched input's copy that this machine lacks (a task running on
    another node than the one that planned it), the copy fetched here first."""
    url = source_name(path)
    if url == path or os.path.isfile(path):
        return path
    fs, key = filesystem(url)
    with storage_errors(url):
        return str(_get_input(fs, url, fs.info(key)))


def source_dir(packed: Path, manifest: dict) -> Path | None:
    """The tokenized directory a packed one (``manifest``) was made from, when it is still where
    it was: its URL (a checked local copy), the path as it was typed (from here, or from the packed
    directory), or the path from the packed directory that pack recorded (``relative``), so the
    pair is found from any working directory."""
    from .shards import is_output_dir

    record = manifest.get("source") or {}
    src, relative = record.get("path"), record.get("relative")
    if not src:
        return None
    if is_url(src):
        try:
            return fetch_output(src, "tokenized")
        except InputError:  # moved or removed since: the caller goes on without it
            return None
    for cand in (Path(src), Path(packed) / src, *([Path(packed) / relative] if isinstance(relative, str) else [])):
        if is_output_dir(cand):
            return cand
    return None


def fetch_output(url: str | Path, kind: str | None = None) -> Path:
    """A local copy of a finished packtool output under ``url`` (its manifest, errors and shards),
    for the commands that read an output whole (``stats``, ``inspect``, ``validate``, ``pack``'s input).

    Shards already cached with the manifest's sha256 are not fetched again; a fetched shard whose
    sha256 differs is refused. A local path is returned as it is.
    """
    if not is_url(str(url)):
        return Path(url)
    from .shards import ERRORS, LEGACY_MANIFEST, MANIFEST, read_manifest, sha256_file

    url = str(url).rstrip("/")
    fs, root = filesystem(url)
    local = cache_dir() / "outputs" / _url_key(url)
    (local / ".packtool").mkdir(parents=True, exist_ok=True)
    with storage_errors(url):
        got = False
        for name in (MANIFEST, ERRORS, LEGACY_MANIFEST):
            try:
                data = read_fresh(fs, f"{root}/{name}")  # published since this process listed the prefix
            except FileNotFoundError:
                (local / name).unlink(missing_ok=True)
                continue
            RequestCounter.add(len(data))
            (local / name).write_bytes(data)
            got = got or name != ERRORS
        if not got:
            _missing_bucket(url)
            raise InputError(f"{url!r} has no {MANIFEST}; is it the output of packtool tokenize/pack, and did that "
                             "run finish?")
        manifest = read_manifest(local, kind, shown=url)
        for entry in manifest["shards"]:
            target = local / entry["file"]
            if target.is_file() and target.stat().st_size == entry["bytes"] and sha256_file(target) == entry["sha256"]:
                continue
            _get_shard(fs, f"{root}/{entry['file']}", f"{url}/{entry['file']}", entry, target)
    keep = {e["file"] for e in manifest["shards"]}
    for f in local.glob("part-*.parquet"):
        if f.name not in keep:
            f.unlink()
    _FETCHED[str(local)] = url
    return local


def _get_shard(fs, path: str, url: str, entry: dict, target: Path) -> None:
    """Download one listed shard to ``target`` (atomically), refusing it unless its sha256 is the manifest's."""
    from .shards import MANIFEST, sha256_file

    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    try:
        fs.get_file(path, str(tmp))
    except FileNotFoundError:
        raise InputError(f"shard {url} listed in {MANIFEST} is missing; re-run the stage that wrote it") from None
    RequestCounter.add(tmp.stat().st_size)
    if sha256_file(tmp) != entry["sha256"]:
        tmp.unlink()
        raise InputError(f"shard {url} does not match the sha256 in {MANIFEST}; it was replaced or modified: re-run "
                         "the stage that wrote it")
    os.replace(tmp, target)


def fetch_shard(url: str, entry: dict, private: bool = False) -> Path:
    """A local copy of the one shard at ``url`` (what a pack task reads), checked against its
    manifest ``entry``'s sha256; named by that hash, so a copy is fetched once per machine.
    The caller removes it when done, so disk holds one shard per worker. ``private``: a copy
    of this process alone (a mixture task reads shards that other tasks read at the same time,
    and removes its copies when it ends)."""
    name = f"{entry['sha256'][:32]}-{os.getpid()}" if private else entry["sha256"][:32]
    target = cache_dir() / "shards" / f"{name}.parquet"
    target.parent.mkdir(parents=True, exist_ok=True)
    if not (target.is_file() and target.stat().st_size == entry["bytes"]):
        fs, path = filesystem(url)
        with storage_errors(url):
            _get_shard(fs, path, url, entry, target)
    return target


def check_listed(url: str, entries: list[dict]) -> None:
    """The cheap check of every shard before a run over ``url``'s shards: one listing, each listed
    shard present with the manifest's size (the sha256 is checked by the task that reads it)."""
    from .shards import MANIFEST

    fs, root = filesystem(url)
    with storage_errors(url):
        sizes = {posixpath.basename(e["name"]): int(e["size"]) for e in fs.ls(root, detail=True, refresh=True)
                 if e.get("type") == "file"}
    RequestCounter.add(0)
    for entry in entries:
        got = sizes.get(entry["file"])
        if got is None:
            raise InputError(f"shard {url}/{entry['file']} listed in {MANIFEST} is missing; re-run the stage that "
                             "wrote it")
        if got != entry["bytes"]:
            raise InputError(f"shard {url}/{entry['file']} is {got:,} bytes but {MANIFEST} says {entry['bytes']:,}; it "
                             "was cut short, replaced or modified: re-run the stage that wrote it, or copy it again")


def fetch_manifest(url: str, kind: str | None = None) -> dict:
    """The manifest of a finished output under ``url`` (fetched alone, checked as a local one is)."""
    from .shards import MANIFEST, read_manifest

    url = str(url).rstrip("/")
    fs, root = filesystem(url)
    local = cache_dir() / "manifests" / _url_key(url)
    (local / ".packtool").mkdir(parents=True, exist_ok=True)
    with storage_errors(url):
        try:
            data = read_fresh(fs, f"{root}/{MANIFEST}")  # published since this process listed the prefix
        except FileNotFoundError:
            _missing_bucket(url)
            raise InputError(f"{url!r} has no {MANIFEST}; is it the output of packtool tokenize/pack, and did that "
                             "run finish?") from None
    RequestCounter.add(len(data))
    (local / MANIFEST).write_bytes(data)
    return read_manifest(local, kind, shown=url)
