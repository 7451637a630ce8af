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
* **Outputs** (``-o s3://bucket/prefix``): :func:`remote_output` (see there): shards are written
  locally, uploaded as whole objects, task markers after them, ``errors.jsonl`` and the
  manifest last; a lease object taken with a conditional put keeps two runs out of one prefix.
* **The reader**: ``PackedDataset("s3://...")`` streams row groups through :class:`GroupCache`.

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
import shutil
import socket
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from .errors import ConfigError, InputError, OutputError, PacktoolError, SampleError

__all__ = [
    "is_url",
    "split_url",
    "join",
    "set_options",
    "storage_options",
    "filesystem",
    "StorageError",
    "storage_errors",
    "cache_dir",
    "RequestCounter",
    "RangedReader",
    "RemoteFile",
    "RemoteRoot",
    "as_root",
    "output_dir",
    "task_target",
    "state_prepared",
    "tasks_ran",
    "fetch_inputs",
    "input_copy",
    "source_name",
    "fetch_output",
    "fetch_manifest",
    "fetch_shard",
    "check_listed",
    "remote_output",
    "task_dir",
    "publish_task",
    "listed_sizes",
    "GroupCache",
    "Prefetcher",
]

log = logging.getLogger(__name__)

#: URL schemes packtool reads and writes, with the fsspec package that serves each.
SCHEMES = {"s3": "s3fs", "s3a": "s3fs", "gs": "gcsfs", "gcs": "gcsfs"}
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
        try:
            fs = fsspec.filesystem(protocol, skip_instance_cache=True, **options)
        except TypeError as exc:
            raise ConfigError(f"--storage-option: {exc}; see the {package} documentation for its options") from None
        _FILESYSTEMS[(protocol, os.getpid())] = fs
    return fs, f"{bucket}/{key}" if key else bucket


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
    if name in ("NoCredentialsError", "PartialCredentialsError", "DefaultCredentialsError") \
            or "credentials" in text.lower() and "invalid" not in text.lower():
        return StorageError(f"no credentials for {url!r}; {_fix_for(scheme)}")
    if name in ("EndpointConnectionError", "ConnectTimeoutError", "ClientConnectorError", "ConnectionError") \
            or isinstance(exc, ConnectionError) or "Could not connect" in text:
        where = storage_options().get("endpoint_url") or os.environ.get("AWS_ENDPOINT_URL") or "the default endpoint"
        return StorageError(f"cannot reach the object store for {url!r} at {where} ({text[:200]}); check the endpoint "
                            "(AWS_ENDPOINT_URL or --storage-option endpoint_url=...) and the network")
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
    default ``~/.cache/packtool``)."""
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

    Example:
        A 3 MB JPEG probed for its size and its end-of-image marker costs two GETs: 16 KiB
        from the start, 4 KiB from the end.
    """

    def __init__(self, fs, path: str, size: int, first_block: int = HEAD_BYTES, max_block: int = 8 << 20,
                 ranges: list[tuple[int, bytes]] | None = None) -> None:
        super().__init__()
        self.fs, self.path, self.size = fs, path, size
        self.pos = 0
        self.block = first_block
        self.max_block = max_block
        # (start, data), few per file; shared with the RemoteFile, so what a prefetch read is used
        self._ranges: list[tuple[int, bytes]] = ranges if ranges is not None else []

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
        self._ranges.append((start, data))
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
            return bool(fs.isdir(path))

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


def fetch_inputs(inputs: list[str | Path]) -> list[str | Path]:
    """Local copies of the input files under URLs (a URL naming a prefix brings every file under it).

    A copy is fetched once and kept while the object's size and time stay the same; its
    modification time is set to the object's, so a resumed run sees unchanged inputs. Local
    inputs pass through unchanged. Rows keep the URL as their ``source`` (:func:`source_name`).
    """
    from .formats import SUFFIXES

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
                entries = [e for k, e in sorted(found.items()) if e.get("type") == "file"
                           and not any(part.startswith(".") for part in k[len(path):].split("/"))
                           and k.endswith(tuple(SUFFIXES))]
                if not entries:
                    raise InputError(f"no input files found under {text!r}; expected {', '.join(SUFFIXES)}")
            elif fs.exists(path):
                entries = [fs.info(path)]
            else:
                raise InputError(f"input {text!r} does not exist")
            out.extend(_get_input(fs, f"{scheme}://{e['name']}", e) for e in entries)
    return out


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
                data = fs.cat_file(f"{root}/{name}")
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
        manifest = read_manifest(local, kind)
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


def fetch_shard(url: str, entry: dict) -> Path:
    """A local copy of the one shard at ``url`` (what a pack task reads), checked against its
    manifest ``entry``'s sha256; named by that hash, so a copy is fetched once per machine.
    The caller removes it when done (:func:`drop_shard`), so disk holds one shard per worker."""
    target = cache_dir() / "shards" / f"{entry['sha256'][:32]}.parquet"
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
            data = fs.cat_file(f"{root}/{MANIFEST}")
        except FileNotFoundError:
            _missing_bucket(url)
            raise InputError(f"{url!r} has no {MANIFEST}; is it the output of packtool tokenize/pack, and did that "
                             "run finish?") from None
    RequestCounter.add(len(data))
    (local / MANIFEST).write_bytes(data)
    return read_manifest(local, kind)


# --------------------------------------------------------------------------- outputs


#: Local mirrors of remote outputs held by this process: mirror path -> RemoteOutput.
_MIRRORS: dict[str, RemoteOutput] = {}


def listed_sizes(out_dir: str | Path) -> dict[str, int] | None:
    """Sizes of the shards in the object store when ``out_dir`` is the local mirror of a remote
    output (what a completion marker is checked against), else ``None``."""
    mirror = _MIRRORS.get(str(out_dir))
    return None if mirror is None else mirror.sizes


def task_dir(out_dir: str) -> Path:
    """Where a task writes its files: ``out_dir`` itself, or for a URL a local staging folder of
    this process (its files are uploaded by :func:`publish_task`, then removed)."""
    if not is_url(out_dir):
        return Path(out_dir)
    path = cache_dir() / "stage" / f"{_url_key(out_dir)}-{_HOST}-{os.getpid()}"
    (path / ".packtool").mkdir(parents=True, exist_ok=True)
    return path


def publish_task(out_dir: str, local: Path, task: int, record: dict) -> None:
    """Make a finished task final: write its completion marker, last.

    For a URL: each shard is uploaded whole (an object appears complete or not at all, and a
    retry writes the same bytes under the same key), then the task's rejected rows, then the
    marker; the staged files are removed. A task killed before its marker is redone by the
    next run, which uploads the same bytes again.
    """
    from .shards import STATE_DIR, marker_path, task_errors_path, write_marker

    if not is_url(out_dir):
        write_marker(local, task, record)
        return
    fs, root = filesystem(out_dir)
    with storage_errors(out_dir, writing=True):
        for s in record["shards"]:
            fs.put_file(str(local / s["file"]), f"{root}/{s['file']}")
            RequestCounter.add(int(s["bytes"]))
        errors = task_errors_path(local, task)
        if errors.is_file() and errors.stat().st_size:
            fs.put_file(str(errors), f"{root}/{STATE_DIR}/{errors.name}")
            RequestCounter.add(errors.stat().st_size)
        marker = (json.dumps(record, indent=1) + "\n").encode()
        fs.pipe_file(f"{root}/{STATE_DIR}/{marker_path(local, task).name}", marker)
        RequestCounter.add(len(marker))
    for s in record["shards"]:
        (local / s["file"]).unlink(missing_ok=True)
    task_errors_path(local, task).unlink(missing_ok=True)


class RemoteOutput:
    """A run's hold on an output prefix in a bucket, and the local mirror of its state.

    The stages keep their local logic (``prepare_run``, completion markers, ``merge_output``)
    and run it on a local folder holding the prefix's ``.packtool/`` state; shards stay in the
    bucket (:func:`listed_sizes` answers for them). What changes in the bucket, in order:

    1. a lease object ``.packtool/lease-RRRRR.json``, created with a conditional put
       (``If-None-Match: *``): a second run of this rank into the prefix is refused, naming
       the holder. The holder renews it; a lease left by a dead process on this host, or one
       not renewed for ``ttl_s``, is taken over.
    2. ``run.json`` (and, when the run replaces another, the old run's objects deleted, the
       manifest first, so no reader ever sees a manifest naming a missing shard);
    3. each task's shards, errors and marker (:func:`publish_task`, from wherever the task runs);
    4. ``errors.jsonl``, then ``manifest.json``: the publication. Shards of this run's tasks that
       no marker names (a killed attempt's) are deleted just before it.

    An object store has no rename; a PUT is atomic per object, shards are the same bytes on
    every attempt, and readers trust only the manifest, written last: so the output is
    all-or-nothing without one.
    """

    def __init__(self, url: str, rank: int | None, overwrite: bool = False, ttl_s: float = 120.0) -> None:
        self.url = str(url).rstrip("/")
        self.fs, self.root = filesystem(self.url)
        self.rank = rank
        self.overwrite = overwrite
        self.ttl_s = ttl_s
        self.mirror = cache_dir() / "mirror" / f"{_url_key(self.url)}-{_HOST}-{os.getpid()}"
        self.sizes: dict[str, int] = {}
        self._pulled: dict[str, bytes] = {}
        self._lease_key = None if rank is None else f"{self.root}/.packtool/lease-{rank:05d}.json"
        self._token = uuid.uuid4().hex
        self._stop = threading.Event()
        self._renewer: threading.Thread | None = None

    # ---- lease

    def _lease_body(self) -> bytes:
        return json.dumps({"pid": os.getpid(), "host": _HOST, "token": self._token,
                           "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
                           "expires": time.time() + self.ttl_s}).encode()

    def _acquire(self) -> None:
        if self._lease_key is None:
            return
        for _ in range(3):
            try:
                self.fs.pipe_file(self._lease_key, self._lease_body(), mode="create")
                RequestCounter.add(0)
            except FileExistsError:
                holder = self._holder()
                if holder is not None and not self._stale(holder):
                    raise OutputError(
                        f"{self.url!r} is being written by another packtool run (pid {holder.get('pid', '?')} on "
                        f"{holder.get('host', '?')}, started {holder.get('started', '?')}); wait for it to finish, "
                        f"or choose another -o") from None
                log.info("%s: taking over the lease of a run that is gone (%s)", self.url, holder)
                with contextlib.suppress(FileNotFoundError):
                    self.fs.rm_file(self._lease_key)
                continue
            holder = self._holder()  # two takers of one stale lease: the one whose token is there holds it
            if holder is None or holder.get("token") != self._token:
                raise OutputError(f"{self.url!r} was just taken by another packtool run; wait for it to finish, or "
                                  "choose another -o")
            self._renewer = threading.Thread(target=self._renew, name="packtool-lease", daemon=True)
            self._renewer.start()
            return
        raise OutputError(f"cannot take the lease on {self.url!r}: it keeps changing hands; wait and run again")

    def _holder(self) -> dict | None:
        try:
            data = self.fs.cat_file(self._lease_key)
            RequestCounter.add(len(data))
            holder = json.loads(data)
        except (FileNotFoundError, ValueError):
            return None
        return holder if isinstance(holder, dict) else {}

    def _stale(self, holder: dict) -> bool:
        if holder.get("host") == _HOST and isinstance(holder.get("pid"), int):
            return not _alive(holder["pid"])
        expires = holder.get("expires")
        return not isinstance(expires, int | float) or expires < time.time()

    def _renew(self) -> None:
        while not self._stop.wait(self.ttl_s / 3):
            with contextlib.suppress(Exception):
                self.fs.pipe_file(self._lease_key, self._lease_body())

    def _release(self) -> None:
        self._stop.set()
        if self._renewer is not None:
            self._renewer.join(timeout=5)
        if self._lease_key is not None and self._renewer is not None:
            holder = self._holder()
            if holder is not None and holder.get("token") == self._token:
                with contextlib.suppress(FileNotFoundError):
                    self.fs.rm_file(self._lease_key)

    # ---- state

    def _list(self) -> tuple[dict[str, int], list[str], list[str]]:
        """Shard sizes, state file names and other visible names under the prefix (one LIST each)."""
        from .shards import SHARD_NAME

        try:
            top = self.fs.ls(self.root, detail=True, refresh=True)
        except FileNotFoundError:
            top = []
        RequestCounter.add(0)
        sizes, foreign = {}, []
        for e in top:
            name = posixpath.basename(e["name"].rstrip("/"))
            if e.get("type") == "file" and SHARD_NAME.fullmatch(name):
                sizes[name] = int(e["size"])
            elif not name.startswith(".") and name not in ("manifest.json", "errors.jsonl"):
                foreign.append(name)
        try:
            state = [posixpath.basename(e["name"]) for e in self.fs.ls(f"{self.root}/.packtool", detail=True, refresh=True)
                     if e.get("type") == "file"]
        except FileNotFoundError:
            state = []
        RequestCounter.add(0)
        return sizes, state, sorted(foreign)

    def pull(self, markers_only: bool = False) -> None:
        """Bring the prefix's state into the mirror: run state, manifest and markers (their errors
        with them); shard sizes from the listing."""
        from .shards import STATE_DIR

        self.sizes, state, foreign = self._list()
        state_dir = self.mirror / STATE_DIR
        state_dir.mkdir(parents=True, exist_ok=True)
        if not markers_only:
            if foreign and not self.overwrite and "run.json" not in state and "manifest.json" not in state:
                shown = ", ".join(repr(n) for n in foreign[:3]) + (f" and {len(foreign) - 3} more" if len(foreign) > 3 else "")
                raise OutputError(f"output {self.url!r} is not empty and holds no packtool run ({shown}); choose a new "
                                  "or empty -o, or pass --overwrite to write there anyway (objects packtool did not "
                                  "write are never removed)")
            if self.fs.isfile(self.root):
                raise OutputError(f"output {self.url!r} is an object, not a prefix; choose another -o")
        wanted = [n for n in state if re.fullmatch(r"task-\d{5}\.json|errors-\d{5}\.jsonl", n)
                  or (not markers_only and n in ("run.json", "manifest.json", "errors.jsonl"))]
        for name in wanted:
            local = state_dir / name
            if markers_only and local.is_file():
                continue
            try:
                data = self.fs.cat_file(f"{self.root}/{STATE_DIR}/{name}")
            except FileNotFoundError:  # removed meanwhile (a rank clearing its task)
                continue
            RequestCounter.add(len(data))
            local.write_bytes(data)
            self._pulled[name] = data

    def push_state(self) -> None:
        """After ``prepare_run``: mirror what it changed (a new ``run.json``; a wiped run) to the bucket."""
        from .shards import STATE_DIR

        state_dir = self.mirror / STATE_DIR
        gone = [n for n in self._pulled if not (state_dir / n).is_file()]
        if gone:  # prepare_run replaced the run: remove its objects, the manifest first
            self._delete([f"{STATE_DIR}/manifest.json"] if "manifest.json" in gone else [])
            self._delete(sorted(self.sizes))
            self._delete([f"{STATE_DIR}/{n}" for n in sorted(gone) if n != "manifest.json"])
            for n in gone:
                self._pulled.pop(n)
            self.sizes = {}
        run = state_dir / "run.json"
        if run.is_file() and run.read_bytes() != self._pulled.get("run.json"):
            self.fs.pipe_file(f"{self.root}/{STATE_DIR}/run.json", run.read_bytes())
            RequestCounter.add(0)
            self._pulled["run.json"] = run.read_bytes()

    def _delete(self, names: list[str]) -> None:
        if names:
            self.fs.rm([f"{self.root}/{n}" for n in names])
            RequestCounter.add(0)

    def publish(self) -> None:
        """Upload ``errors.jsonl`` and then the manifest when the local merge wrote new ones."""
        from .shards import ERRORS, MANIFEST

        manifest = self.mirror / MANIFEST
        if not manifest.is_file() or manifest.read_bytes() == self._pulled.get("manifest.json"):
            return
        listed = {s["file"] for s in json.loads(manifest.read_text(encoding="utf-8"))["shards"]}
        strays = [n for n in sorted(self.sizes) if n not in listed and re.fullmatch(r"part-\d{5}-\d{5}\.parquet", n)]
        self._delete(strays)  # shards of killed attempts that no marker names
        errors = self.mirror / ERRORS
        if errors.is_file():
            self.fs.put_file(str(errors), f"{self.root}/{ERRORS}")
            RequestCounter.add(errors.stat().st_size)
        self.fs.put_file(str(manifest), f"{self.root}/{MANIFEST}")
        RequestCounter.add(manifest.stat().st_size)
        self._pulled["manifest.json"] = manifest.read_bytes()

    def drop_unmarked(self, tasks: list[int]) -> None:
        """A failed run: remove the uploaded shards of ``tasks`` that have no completion marker."""
        from .shards import marker_path, task_prefix

        self.sizes, state, _ = self._list()
        names = [n for t in tasks if marker_path(self.mirror, t).name not in state
                 for n in self.sizes if n.startswith(task_prefix(t) + "-")]
        self._delete(names)


@contextlib.contextmanager
def remote_output(url: str, rank: int | None, overwrite: bool = False) -> Iterator[RemoteOutput]:
    """Hold ``url`` for one run of ``rank`` (``None``: ``merge``, which takes no lease) and yield
    its :class:`RemoteOutput`, whose ``mirror`` the stage runs its state logic on; on success
    the new ``errors.jsonl`` and manifest are published, last."""
    out = RemoteOutput(url, rank, overwrite)
    with storage_errors(out.url, writing=True):
        _sweep_dead(out.url)
        shutil.rmtree(out.mirror, ignore_errors=True)
        out._acquire()
    try:
        with storage_errors(out.url, writing=True):
            out.pull()
        _MIRRORS[str(out.mirror)] = out
        yield out
        with storage_errors(out.url, writing=True):
            out.publish()
    finally:
        _MIRRORS.pop(str(out.mirror), None)
        shutil.rmtree(out.mirror, ignore_errors=True)
        with contextlib.suppress(Exception):
            out._release()


def _sweep_dead(url: str) -> None:
    """Remove the local mirror and staging folders that dead processes of this host left for ``url``."""
    key = _url_key(url)
    for kind in ("mirror", "stage"):
        base = cache_dir() / kind
        if not base.is_dir():
            continue
        for d in base.glob(f"{key}-{_HOST}-*"):
            pid = d.name.rsplit("-", 1)[-1]
            if pid.isdigit() and not _alive(int(pid)):
                shutil.rmtree(d, ignore_errors=True)


# --------------------------------------------------------------------------- the reader's cache


class GroupCache:
    """Row groups of remote shards on local disk, within ``max_bytes``, least recently used out first.

    Each shard is cached as a sparse local file of its full size: the footer and every row group
    fetched so far are written at their own offsets (one ranged GET per group, by the reader or by
    a :class:`Prefetcher` running ahead of it), the rest is holes that take no disk. pyarrow then
    reads a cached group natively, as fast as from a local shard. ``NAME.have`` lists the groups
    present; files are named by the shard's sha256, so a cache is shared by every URL holding the
    same shard and survives restarts. An evicted group's bytes are given back to the file system
    (a punched hole, or the whole file where holes cannot be punched).

    Example:
        >>> cache = GroupCache(max_bytes=2 << 30)                                  # doctest: +SKIP
        >>> pq.ParquetFile(cache.path(url, size, sha256, group=0)).read_row_group(0)
    """

    def __init__(self, max_bytes: int = 4 << 30, directory: Path | None = None, keep: int = 6) -> None:
        self.max_bytes = max_bytes
        #: the newest groups are never evicted: the one being read and those prefetched after it
        #: (so the cap may be passed by up to ``keep`` groups)
        self.keep = max(1, keep)
        self.dir = directory or cache_dir() / "reader"
        self.dir.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._lru: OrderedDict[tuple[str, int], int] = OrderedDict()  # (name, group or -1 = footer) -> bytes
        self._inflight: dict[tuple[str, int], threading.Event] = {}
        self._footers: dict[str, tuple[int, list[tuple[int, int]]]] = {}  # name -> (footer start, group spans)
        for have in sorted(self.dir.glob("*.have"), key=lambda f: f.stat().st_mtime):  # a warm cache
            for key, n in self._read_have(have.stem).items():
                self._lru[(have.stem, key)] = n
        self._evict()

    @property
    def used_bytes(self) -> int:
        return sum(self._lru.values())

    @staticmethod
    def _name(sha256: str) -> str:
        return sha256[:32]

    def _read_have(self, name: str) -> dict[int, int]:
        """Groups present in the cached file ``name`` (``-1``: the footer) and their sizes."""
        try:
            lines = (self.dir / f"{name}.have").read_text().split()
        except FileNotFoundError:
            return {}
        out = {}
        for line in lines:
            g, _, n = line.partition(":")
            if g.lstrip("-").isdigit() and n.isdigit():
                out[int(g)] = int(n)
        return out

    def _write(self, name: str, size: int, offset: int, data: bytes, key: int) -> None:
        """Write ``data`` at ``offset`` of the sparse file, then record it present (in that order,
        so a crash between the two only costs a second fetch)."""
        fd = os.open(self.dir / f"{name}.parquet", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            if os.fstat(fd).st_size != size:
                os.ftruncate(fd, size)
            os.pwrite(fd, data, offset)
        finally:
            os.close(fd)
        with open(self.dir / f"{name}.have", "a") as fh:  # one short line: appends do not interleave
            fh.write(f"{key}:{len(data)}\n")
        with self._lock:
            self._lru[(name, key)] = len(data)
            self._lru.move_to_end((name, key))
        self._evict()

    def _ensure(self, name: str, key: int, fetch) -> None:
        """Make part ``key`` of ``name`` present, fetching it once however many threads ask."""
        while True:
            with self._lock:
                if (name, key) in self._lru:
                    self._lru.move_to_end((name, key))
                    return
                wait = self._inflight.get((name, key))
                if wait is None:
                    self._inflight[(name, key)] = threading.Event()
                    break
            wait.wait()
        try:
            if key not in self._read_have(name):  # another process may have fetched it
                fetch()
            else:
                with self._lock:
                    self._lru[(name, key)] = self._read_have(name)[key]
        finally:
            with self._lock:
                self._inflight.pop((name, key)).set()

    def footer(self, url: str, size: int, sha256: str) -> tuple[int, list[tuple[int, int]]]:
        """``(footer start, [(start, end) of each row group])`` of a shard, its footer made present."""
        name = self._name(sha256)
        got = self._footers.get(name)
        if got is not None and (name, -1) in self._lru:
            return got

        def fetch() -> None:
            tail = self._fetch_footer(url, size)
            self._write(name, size, size - len(tail), tail, -1)

        self._ensure(name, -1, fetch)
        import pyarrow.parquet as pq

        meta = pq.ParquetFile(self.dir / f"{name}.parquet").metadata
        spans = []
        for g in range(meta.num_row_groups):
            rg = meta.row_group(g)
            chunks = [rg.column(i) for i in range(rg.num_columns)]
            starts = [c.dictionary_page_offset if c.has_dictionary_page else c.data_page_offset for c in chunks]
            spans.append((int(min(starts)), int(max(s + c.total_compressed_size for s, c in zip(starts, chunks, strict=True)))))
        got = (size - self._read_have(name).get(-1, 0), spans)
        self._footers[name] = got
        return got

    def _fetch_footer(self, url: str, size: int) -> bytes:
        fs, path = filesystem(url)
        n = min(size, 64 << 10)
        with storage_errors(url):
            try:
                actual = int(fs.info(path)["size"])
            except FileNotFoundError:
                raise InputError(f"shard {url!r} is listed in the manifest but missing; re-run packtool pack") from None
            RequestCounter.add(0)
            if actual != size:
                raise InputError(f"shard {url!r} is {actual:,} bytes but the manifest says {size:,}; it was "
                                 "replaced or modified: re-run packtool pack")
            tail = fs.cat_file(path, start=size - n, end=size)
            RequestCounter.add(len(tail))
            meta_len = int.from_bytes(tail[-8:-4], "little")
            if tail[-4:] != b"PAR1" or meta_len + 8 > size:
                raise InputError(f"shard {url!r} is not a Parquet file (its footer is damaged); re-run packtool pack")
            if meta_len + 8 > n:
                tail = fs.cat_file(path, start=size - meta_len - 8, end=size)
                RequestCounter.add(len(tail))
        return tail

    def metadata(self, url: str, size: int, sha256: str):
        """The Parquet footer of a shard (row group sizes), from the cache or one or two ranged GETs."""
        import pyarrow.parquet as pq

        self.footer(url, size, sha256)
        return pq.ParquetFile(self.dir / f"{self._name(sha256)}.parquet").metadata

    def fetch_group(self, url: str, size: int, sha256: str, group: int) -> None:
        """Make row group ``group`` of the shard present (one ranged GET when it is not)."""
        name = self._name(sha256)
        _, spans = self.footer(url, size, sha256)
        lo, hi = spans[group]

        def fetch() -> None:
            fs, path = filesystem(url)
            with storage_errors(url):
                data = fs.cat_file(path, start=lo, end=hi)
            RequestCounter.add(len(data))
            self._write(name, size, lo, data, group)

        self._ensure(name, group, fetch)

    def path(self, url: str, size: int, sha256: str, group: int) -> Path:
        """The local sparse file of the shard, with its footer and row group ``group`` present."""
        self.fetch_group(url, size, sha256, group)
        return self.dir / f"{self._name(sha256)}.parquet"

    def _evict(self) -> None:
        while True:
            with self._lock:
                groups = [k for k in self._lru if k[1] >= 0]
                if sum(self._lru.values()) <= self.max_bytes or len(groups) <= self.keep:
                    return
                name, g = groups[0]  # the least recently used group (footers go with their file)
                n = self._lru.pop((name, g))
                _, spans = self._footers.get(name, (0, []))
                last = not any(k[0] == name and k[1] >= 0 for k in self._lru)
                if last:
                    self._lru.pop((name, -1), None)
                    self._footers.pop(name, None)
            if last or not spans or not _punch_hole(self.dir / f"{name}.parquet", spans[g][0], n):
                with self._lock:  # no hole to punch: the whole file goes
                    for k in [k for k in self._lru if k[0] == name]:
                        self._lru.pop(k)
                    self._footers.pop(name, None)
                (self.dir / f"{name}.have").unlink(missing_ok=True)
                (self.dir / f"{name}.parquet").unlink(missing_ok=True)
                continue
            have = self._read_have(name)
            have.pop(g, None)
            tmp = self.dir / f".{name}.have.{os.getpid()}.{threading.get_ident()}.tmp"
            tmp.write_text("".join(f"{k}:{v}\n" for k, v in have.items()))
            os.replace(tmp, self.dir / f"{name}.have")


def _punch_hole(file: Path, offset: int, length: int) -> bool:
    """Give ``length`` bytes at ``offset`` of ``file`` back to the file system, keeping its size
    (``fallocate(PUNCH_HOLE | KEEP_SIZE)``); ``False`` where that is not available."""
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        fd = os.open(file, os.O_RDWR)
    except (OSError, AttributeError):
        return False
    try:
        return libc.fallocate(fd, 0x03, ctypes.c_long(offset), ctypes.c_long(length)) == 0
    except AttributeError:  # no fallocate in this C library (not Linux)
        return False
    finally:
        os.close(fd)


class Prefetcher:
    """Fetches row groups into a :class:`GroupCache` ahead of the reader, never more than
    ``ahead`` groups beyond the one it reads (:meth:`advance` moves that on), on ``threads``
    threads; :meth:`close` stops it (the reader stopped early, or finished).

    ``items`` are ``(url, size, sha256, group)`` in reading order. A failed fetch is left for
    the reader, which fetches the group itself and raises the error where it can be seen.
    """

    def __init__(self, cache: GroupCache, items: Iterator[tuple[str, int, str, int]], ahead: int = 4,
                 threads: int = 4) -> None:
        self.cache = cache
        self.ahead = max(1, ahead)
        self._items = enumerate(items)
        self._next = threading.Lock()  # planning may fetch footers: never under the condition's lock
        self._cond = threading.Condition()
        self._used = 0
        self._stop = False
        self._threads = [threading.Thread(target=self._run, name="packtool-prefetch", daemon=True)
                         for _ in range(max(1, min(threads, self.ahead)))]
        for t in self._threads:
            t.start()

    def _run(self) -> None:
        while not self._stop:
            with self._next:
                try:
                    k, item = next(self._items)
                except StopIteration:
                    return
                except Exception:  # noqa: BLE001 - planning failed (a damaged footer): the reader reports it
                    return
            with self._cond:
                self._cond.wait_for(lambda k=k: self._stop or k < self._used + self.ahead)
                if self._stop:
                    return
            with contextlib.suppress(Exception):
                self.cache.fetch_group(*item)

    def advance(self) -> None:
        with self._cond:
            self._used += 1
            self._cond.notify_all()

    def close(self) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify_all()


# --------------------------------------------------------------------------- what the stages call


@contextlib.contextmanager
def output_dir(out: str | Path, rank: int | None, overwrite: bool = False) -> Iterator[Path]:
    """Hold the output ``out`` for one run of ``rank`` and yield the folder its state logic runs on.

    A local directory is held by :func:`~packtool.shards.run_lock` and yielded as it is; a URL by
    :func:`remote_output`, yielding the local mirror of its state (``rank=None``: no lease, for merge).
    """
    if not is_url(str(out)):
        from .shards import run_lock

        if rank is None:
            yield Path(out)
            return
        with run_lock(Path(out), rank):
            yield Path(out)
        return
    with remote_output(str(out), rank, overwrite) as remote:
        yield remote.mirror


def task_target(out: Path) -> str:
    """What a task is told to write to: the URL when ``out`` mirrors a remote output, else ``out``."""
    mirror = _MIRRORS.get(str(out))
    return mirror.url if mirror is not None else str(out)


def state_prepared(out: Path) -> None:
    """After ``prepare_run`` on a mirror: push the run state it wrote (or the wipe it made)."""
    mirror = _MIRRORS.get(str(out))
    if mirror is not None:
        with storage_errors(mirror.url, writing=True):
            mirror.push_state()


def tasks_ran(out: Path) -> None:
    """After tasks ran elsewhere: bring their markers (and errors) into the mirror."""
    mirror = _MIRRORS.get(str(out))
    if mirror is not None:
        with storage_errors(mirror.url, writing=True):
            mirror.pull(markers_only=True)
