"""The reader's local cache of a bucket's shards: row groups fetched whole, kept within a byte cap.

Used by :class:`~packtool.reader.PackedDataset` when its path is an ``s3://`` or ``gs://`` URL.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections import Counter, OrderedDict
from collections.abc import Iterator
from pathlib import Path

from ..errors import InputError
from ..storage import RequestCounter, cache_dir, filesystem, storage_errors

__all__ = ["GroupCache", "Prefetcher", "COALESCE_BYTES"]

#: Fewer, larger requests: a shard of at most this size is fetched whole, footer and every row
#: group in one GET; a smaller row group is fetched together with the groups after it in the
#: file, up to this many bytes in one GET. Capped at a quarter of the cache, so what is fetched
#: ahead of its turn cannot push out the groups being read.
COALESCE_BYTES = 8 << 20
#: Reads of a cached shard that failed and are fetched again before the error is reported: every
#: process on the machine (ranks, DataLoader workers) shares the cache directory and evicts within
#: its own cap, so a part may go between its fetch and its read.
RETRIES = 2


class GroupCache:
    """Row groups of remote shards on local disk, within ``max_bytes``, least recently used out first.

    Each shard is cached as a sparse local file of its full size: the footer and every row group
    fetched so far are written at their own offsets (ranged GETs by the reader or by a
    :class:`Prefetcher` running ahead of it: a small shard whole in one GET, small groups
    together with their neighbours, see :data:`COALESCE_BYTES`), the rest is holes that take no disk. pyarrow then
    reads a cached group natively, as fast as from a local shard. ``NAME.have`` lists the groups
    present; files are named by the shard's sha256, so a cache is shared by every URL holding the
    same shard and survives restarts. An evicted group's bytes are given back to the file system
    (a punched hole, or the whole file where holes cannot be punched).

    Example::

        cache = GroupCache(max_bytes=2 << 30)
        pq.ParquetFile(cache.path(url, size, sha256, group=0)).read_row_group(0)
    """

    def __init__(self, max_bytes: int = 4 << 30, directory: Path | None = None, keep: int = 6,
                 coalesce_bytes: int | None = None) -> None:
        self.max_bytes = max_bytes
        self.coalesce_bytes = max(0, min(COALESCE_BYTES if coalesce_bytes is None else coalesce_bytes, max_bytes // 4))
        #: the newest groups are never evicted: the one being read and those prefetched after it
        #: (so the cap may be passed by up to ``keep`` groups)
        self.keep = max(1, keep)
        self.dir = directory or cache_dir() / "reader"
        self.dir.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        #: groups being read (:meth:`held`), by how many readers: never evicted while held
        self._pinned: Counter[tuple[str, int]] = Counter()
        self._lru: OrderedDict[tuple[str, int], int] = OrderedDict()  # (name, group or -1 = footer) -> bytes
        self._inflight: dict[tuple[str, int], threading.Event] = {}
        self._footers: dict[str, tuple[int, list[tuple[int, int]]]] = {}  # name -> (footer start, group spans)
        for have in sorted(self.dir.glob("*.have"), key=_mtime):  # a warm cache
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

    def _write(self, name: str, size: int, offset: int, data: bytes, parts: dict[int, int] | None) -> None:
        """Write ``data`` at ``offset`` of the sparse file, then record ``parts`` (group or ``-1``
        -> bytes) present, the last one newest (in that order, so a crash between the two only
        costs a second fetch)."""
        fd = os.open(self.dir / f"{name}.parquet", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            if os.fstat(fd).st_size != size:
                os.ftruncate(fd, size)
            os.pwrite(fd, data, offset)
        finally:
            os.close(fd)
        if parts is not None:
            self._record(name, parts)

    def _record(self, name: str, parts: dict[int, int]) -> None:
        with open(self.dir / f"{name}.have", "a") as fh:  # short lines in one write: appends do not interleave
            fh.write("".join(f"{k}:{n}\n" for k, n in parts.items()))
        with self._lock:
            for k, n in parts.items():
                self._lru[(name, k)] = n
                self._lru.move_to_end((name, k))
        self._evict()

    def _ensure(self, name: str, key: int, fetch, after: tuple[int, ...] = ()) -> None:
        """Make part ``key`` of ``name`` present, fetching it once however many threads ask.

        ``fetch(run)`` gets ``key`` and those of ``after`` (the groups that follow it in the
        file) that are neither present nor being fetched, up to the first that is: the run one
        GET brings in; every part of it counts as being fetched until it is written.
        """
        while True:
            with self._lock:
                if (name, key) in self._lru and self._still_present(name, key):
                    self._lru.move_to_end((name, key))
                    return
                wait = self._inflight.get((name, key))
                if wait is None:
                    run = [key]
                    for k in after:
                        if k != run[-1] + 1 or (name, k) in self._lru or (name, k) in self._inflight:
                            break
                        run.append(k)
                    event = threading.Event()
                    for k in run:
                        self._inflight[(name, k)] = event
                    break
            wait.wait()
        try:
            have = self._read_have(name)
            if key not in have:  # another process may have fetched it
                fetch(run)
            else:
                with self._lock:
                    self._lru[(name, key)] = have[key]
        finally:
            with self._lock:
                for k in run:
                    self._inflight.pop((name, k), None)
            event.set()

    def _still_present(self, name: str, key: int) -> bool:
        """Whether part ``key`` of ``name``, present by this process's records, is still on disk. Every
        process reading the bucket on this machine (ranks, DataLoader workers) shares the directory
        and evicts within its own cap: another may have punched the part out or removed the file.
        When it has, this process forgets what it recorded of ``name`` that is gone (called under
        the lock), so the part is fetched again."""
        have = self._read_have(name)
        if key in have and (self.dir / f"{name}.parquet").exists():
            return True
        for k in [k for k in self._lru if k[0] == name and k[1] not in have]:
            self._lru.pop(k)
        if -1 not in have:
            self._footers.pop(name, None)
        return False

    def forget(self, sha256: str) -> None:
        """Drop what this process recorded of a shard's cached parts (they are fetched again when
        asked for): a read of them failed, e.g. another process sharing the directory evicted them
        between the fetch and the read."""
        name = self._name(sha256)
        with self._lock:
            for k in [k for k in self._lru if k[0] == name]:
                self._lru.pop(k)
            self._footers.pop(name, None)
        (self.dir / f"{name}.have").unlink(missing_ok=True)

    def footer(self, url: str, size: int, sha256: str) -> tuple[int, list[tuple[int, int]]]:
        """``(footer start, [(start, end) of each row group])`` of a shard, its footer made present."""
        name = self._name(sha256)
        got = self._footers.get(name)
        with self._lock:
            if got is not None and (name, -1) in self._lru and self._still_present(name, -1):
                return got

        def fetch(_run) -> None:
            tail = self._fetch_footer(url, size)
            if len(tail) < size:
                self._write(name, size, size - len(tail), tail, {-1: len(tail)})
                return
            self._write(name, size, 0, tail, None)  # the whole shard came: every row group is present too
            spans = _spans(self.dir / f"{name}.parquet")
            last = max((hi for _, hi in spans), default=0)
            self._record(name, {-1: size - last, **{g: hi - lo for g, (lo, hi) in enumerate(spans)}})

        self._ensure(name, -1, fetch)
        got = (size - self._read_have(name).get(-1, 0), _spans(self.dir / f"{name}.parquet"))
        self._footers[name] = got
        return got

    def _fetch_footer(self, url: str, size: int) -> bytes:
        """The shard's last bytes, its footer among them: the whole shard when it is small (one GET
        either way). No HEAD first: the manifest gives the size, and a shard of another size
        shows in the number of bytes that come back, which is when the size is asked for."""
        fs, path = filesystem(url)
        n = size if size <= self.coalesce_bytes else min(size, 64 << 10)
        with storage_errors(url):
            try:
                # one byte past the end: a store clips the range to the object, so a longer
                # object shows as one byte too many, a shorter one as bytes too few
                tail = fs.cat_file(path, start=size - n, end=size + 1)
            except FileNotFoundError:
                raise InputError(f"shard {url!r} is listed in the manifest but missing; re-run packtool pack") from None
            except Exception:
                self._check_size(fs, path, url, size)  # a shorter object: say so, else the store's error
                raise
            RequestCounter.add(len(tail))
            meta_len = int.from_bytes(tail[-8:-4], "little")
            if len(tail) != n or tail[-4:] != b"PAR1" or meta_len + 8 > size:
                self._check_size(fs, path, url, size)
                raise InputError(f"shard {url!r} is not a Parquet file (its footer is damaged); re-run packtool pack")
            if meta_len + 8 > n:
                tail = fs.cat_file(path, start=size - meta_len - 8, end=size)
                RequestCounter.add(len(tail))
        return tail

    @staticmethod
    def _check_size(fs, path: str, url: str, size: int) -> None:
        """Raise the error naming both sizes when the object is not of the manifest's ``size``."""
        actual = int(fs.info(path)["size"])
        RequestCounter.add(0)
        if actual != size:
            raise InputError(f"shard {url!r} is {actual:,} bytes but the manifest says {size:,}; it was "
                             "replaced or modified: re-run packtool pack")

    def metadata(self, url: str, size: int, sha256: str):
        """The Parquet footer of a shard (row group sizes), from the cache or one or two ranged GETs."""
        import pyarrow.parquet as pq

        def read():
            self.footer(url, size, sha256)
            return pq.ParquetFile(self.dir / f"{self._name(sha256)}.parquet").metadata

        return self.refetching(sha256, read)

    def refetching(self, sha256: str, read):
        """``read()`` of a cached shard's parts, fetched again (:meth:`forget`) and read again up to
        :data:`RETRIES` times when it fails: other processes on this machine (ranks, DataLoader
        workers) share the directory and evict within their own caps, so a part may go between its
        fetch and its read. Failing every time, the error is the shard's own."""
        for attempt in range(RETRIES + 1):
            try:
                return read()
            except (OSError, ValueError):
                if attempt == RETRIES:
                    raise
                self.forget(sha256)

    def fetch_group(self, url: str, size: int, sha256: str, group: int) -> None:
        """Make row group ``group`` of the shard present (one ranged GET when it is not)."""
        name = self._name(sha256)
        _, spans = self.footer(url, size, sha256)
        # the groups after this one in the file that one GET of at most coalesce_bytes also brings
        after = tuple(g for g in range(group + 1, len(spans)) if spans[g][1] - spans[group][0] <= self.coalesce_bytes)

        def fetch(run: list[int]) -> None:
            lo = spans[run[0]][0]
            data = _get_range(url, lo, spans[run[-1]][1])
            # the group asked for last: the newest in the cache
            self._write(name, size, lo, data, {g: spans[g][1] - spans[g][0] for g in [*run[1:], run[0]]})

        self._ensure(name, group, fetch, after)

    def path(self, url: str, size: int, sha256: str, group: int) -> Path:
        """The local sparse file of the shard, with its footer and row group ``group`` present."""
        self.fetch_group(url, size, sha256, group)
        return self.dir / f"{self._name(sha256)}.parquet"

    @contextlib.contextmanager
    def held(self, url: str, size: int, sha256: str, group: int) -> Iterator[Path]:
        """:meth:`path`, with row group ``group`` kept present until the block ends: this process
        evicts it for no other group meanwhile. The newest ``keep`` groups were the only guard, and
        a small shard fetched whole (footer and every group in one GET, recorded at once) could push
        the group being read out of them, to be punched out under the read."""
        name = self._name(sha256)
        key = (name, group)
        while True:
            self.fetch_group(url, size, sha256, group)
            with self._lock:
                if key in self._lru:  # not evicted since (evicting pops it under this lock first)
                    self._pinned[key] += 1
                    break
        try:
            yield self.dir / f"{name}.parquet"
        finally:
            with self._lock:
                self._pinned[key] -= 1
                if not self._pinned[key]:
                    del self._pinned[key]

    def _evict(self) -> None:
        # under the lock throughout: a group is taken off the records and punched out in one step, so
        # no reader finds it recorded (or pins it, :meth:`held`) while its bytes go
        with self._lock:
            while True:
                groups = [k for k in self._lru if k[1] >= 0 and k not in self._pinned]
                if sum(self._lru.values()) <= self.max_bytes or len(groups) <= self.keep:
                    return
                name, g = groups[0]  # the least recently used group (footers go with their file)
                n = self._lru.pop((name, g))
                _, spans = self._footers.get(name, (0, []))
                last = not any(k[0] == name and k[1] >= 0 for k in self._lru)
                if last:
                    self._lru.pop((name, -1), None)
                    self._footers.pop(name, None)
                if not last and not spans:
                    # a shard whose footer this process has not parsed yet (it is being recorded right now, or
                    # its groups were listed by another process): the spans are in the local footer; without
                    # them the whole file, footer and the groups being read, would go
                    with contextlib.suppress(OSError, ValueError):
                        spans = _spans(self.dir / f"{name}.parquet")
                if last or g >= len(spans) or not _punch_hole(self.dir / f"{name}.parquet", spans[g][0], n):
                    if any(k[0] == name for k in self._pinned):
                        continue  # no hole to punch, and a group of the file is being read: the file stays
                    for k in [k for k in self._lru if k[0] == name]:  # no hole to punch: the whole file goes
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


def _get_range(url: str, lo: int, hi: int) -> bytes:
    """Bytes ``[lo, hi)`` of ``url`` in one ranged GET, refused when the object ends before ``hi``.

    (Splitting a large range into parts requested at once was measured against the storage
    bench's moto server on two shared cores: no gain, more requests billed.)
    """
    fs, path = filesystem(url)
    with storage_errors(url):
        data = fs.cat_file(path, start=lo, end=hi)
    RequestCounter.add(len(data))
    if len(data) != hi - lo:
        raise InputError(f"shard {url!r} ended early ({len(data):,} of {hi - lo:,} bytes at {lo:,}); it was "
                         "replaced or modified: re-run packtool pack")
    return data


def _spans(file: Path) -> list[tuple[int, int]]:
    """``(start, end)`` in the file of each row group of a Parquet file whose footer is present."""
    import pyarrow.parquet as pq

    meta = pq.ParquetFile(file).metadata
    spans = []
    for g in range(meta.num_row_groups):
        rg = meta.row_group(g)
        chunks = [rg.column(i) for i in range(rg.num_columns)]
        starts = [c.dictionary_page_offset if c.has_dictionary_page else c.data_page_offset for c in chunks]
        spans.append((int(min(starts)), int(max(s + c.total_compressed_size for s, c in zip(starts, chunks, strict=True)))))
    return spans


def _mtime(file: Path) -> float:
    """``file``'s modification time; 0 for one removed since it was listed (another process sharing
    the directory evicted it: its parts then read as absent)."""
    try:
        return file.stat().st_mtime
    except FileNotFoundError:
        return 0.0


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
