"""Media probing without decoding pixels, frame extraction, and path resolution under ``--media-root``.

Tokenize only needs dimensions and video metadata:

* images: Pillow reads the size (and the EXIF orientation) from the header; a cheap
  tail check (JPEG end-of-image marker, PNG ``IEND`` chunk, GIF trailer, WebP RIFF
  size; BMP and TIFF: the pixel data their header places fits the file) catches
  truncated files without decoding a pixel;
* videos: PyAV reads the container and stream headers; missing fields fall back in
  a fixed order (see :func:`probe_video`); a file that stores no exact frame count
  (all but a constant-rate MP4/MOV) is demuxed, never decoded, to count its frames.

Pack extracts the exact frames a tokenized row recorded (:func:`extract_frames`), and the reader
decodes a video packed by reference with the same rule (:func:`counted_frames`).
"""

from __future__ import annotations

import io
import logging
import os
import re
import stat
import warnings
from bisect import bisect_left, bisect_right, insort
from collections import deque
from dataclasses import dataclass
from pathlib import Path

from PIL import Image

from .errors import SampleError
from .records import MediaRef
from .storage import BUCKET_URLS, split_url
from .vision import VideoMeta

__all__ = [
    "IMAGE_FORMATS",
    "VIDEO_CONTAINERS",
    "open_image",
    "video_demuxer",
    "ImageInfo",
    "resolve_media_path",
    "recorded_media_path",
    "MediaPathResolver",
    "probe_image",
    "verify_complete",
    "probe_video",
    "extract_frames",
    "counted_frames",
    "read_media_bytes",
]

log = logging.getLogger(__name__)

_EXIF_ORIENTATION = 0x0112
_URL_START = re.compile(r"[a-zA-Z][a-zA-Z0-9+.-]*://")
_TAIL = 4096


#: Image formats packtool opens (Pillow format names): those the model families' processors
#: read. Pillow's others stay closed: EPS and PDF hand work to Ghostscript, and rare decoders
#: are attack surface a training corpus does not need. Anything else is ``unsupported_media``.
IMAGE_FORMATS = ("JPEG", "PNG", "WEBP", "GIF", "BMP", "TIFF")  # JPEG includes MPO (phone photos)
#: First bytes of documents that are not images (PDF, PostScript/EPS, SVG/XML).
_DOCUMENTS = (b"%PDF", b"%!PS", b"\xc5\xd0\xd3\xc6", b"<?xml", b"<svg")
#: ``ftyp`` brands of HEIF-family images (HEIC, AVIF and their sequences): ISO-BMFF files like MP4,
#: but pictures, which FFmpeg would read as one-frame videos.
_HEIF_BRANDS = {b"avif": "AVIF", b"avis": "AVIF", b"heic": "HEIF (HEIC)", b"heix": "HEIF (HEIC)",
                b"heim": "HEIF (HEIC)", b"heis": "HEIF (HEIC)", b"hevc": "HEIF (HEIC)", b"hevx": "HEIF (HEIC)",
                b"hevm": "HEIF (HEIC)", b"hevs": "HEIF (HEIC)", b"mif1": "HEIF", b"mif2": "HEIF", b"msf1": "HEIF"}

#: Video containers packtool opens, each with the FFmpeg demuxer chosen from its first bytes
#: (:func:`video_demuxer`), so FFmpeg never probes a file into a playlist or concat list
#: (HLS ``.m3u8``, ``ffconcat``), formats that open other files or URLs.
VIDEO_CONTAINERS = "MP4/MOV/3GP, Matroska/WebM, AVI, MPEG-TS, MPEG-PS, FLV, Ogg, ASF/WMV, raw H.264"


def _unsupported(what: str) -> SampleError:
    return SampleError("unsupported_media", f"{what}; packtool reads images in {', '.join(IMAGE_FORMATS)} "
                                            "(convert the file, e.g. to PNG)")


def open_image(source: Path | bytes | io.IOBase) -> Image.Image:
    """``Image.open`` restricted to :data:`IMAGE_FORMATS`: the one way packtool opens an image.

    Raises:
        SampleError: ``unsupported_media`` when the file is a format outside the allow-list
            (named when Pillow knows it), e.g. EPS; other failures propagate as Pillow raises them.
    """
    # a remote file (a bucket --media-root) is read through ranged GETs, only as far as Pillow asks
    fp = io.BytesIO(source) if isinstance(source, bytes) else source.open("rb") if _is_remote(source) else source
    try:
        return Image.open(fp, formats=IMAGE_FORMATS)
    except Image.UnidentifiedImageError:
        head = _head(source)
        heif = _heif_image(head)
        if heif is not None:
            raise _unsupported(f"the image is {heif}, an image format outside the allow-list") from None
        container = _video_container(head)
        if container is not None:
            named = {"mov": "MP4/MOV", "matroska": "Matroska/WebM"}.get(container, container.upper())
            raise SampleError("unsupported_media", f"the image is a video ({named} container), not an image; "
                                                   "list it as a video (under the record's video or videos "
                                                   "key, with a <video> tag)") from None
        other = _other_format(source, head)
        if other is not None:
            raise _unsupported(f"the image is {other}") from None
        raise


def _head(source: Path | bytes | io.IOBase, n: int = 377) -> bytes:
    """The first ``n`` bytes of a media file (enough for :func:`_video_container`)."""
    if isinstance(source, bytes):
        return source[:n]
    if isinstance(source, io.IOBase):
        source.seek(0)
        head = source.read(n)
        source.seek(0)
        return head
    with _open_rb(source) as fh:
        return fh.read(n)


def _video_container(head: bytes) -> str | None:
    """The demuxer of a file that is surely a video (:func:`video_demuxer`), or ``None``.

    Stricter than :func:`video_demuxer`, which is only asked about files given as videos:
    raw H.264's start code is a few zero bytes, and one MPEG-TS sync byte is a ``G``, so
    neither alone says that a broken image (``GIF8…``) is a video; three TS packets in a row do.

    Example:
        >>> _video_container(b"\\x00\\x00\\x00\\x18ftypmp42"), _video_container(b"GIF89a")
        ('mov', None)
    """
    demuxer = video_demuxer(head)
    if demuxer == "h264" or (demuxer == "mpegts" and head[188:189] + head[376:377] != b"GG"):
        return None
    return demuxer


def _heif_image(head: bytes) -> str | None:
    """``"AVIF"``, ``"HEIF (HEIC)"`` or ``"HEIF"`` when ``head`` opens a HEIF-family image (its
    ``ftyp`` box names an image brand, major or compatible), else ``None``.

    Example:
        >>> _heif_image(b"\\x00\\x00\\x00\\x18ftypheic\\x00\\x00\\x00\\x00mif1heic"), _heif_image(b"\\x00\\x00\\x00\\x18ftypmp42")
        ('HEIF (HEIC)', None)
    """
    if head[4:8] != b"ftyp":
        return None
    size = int.from_bytes(head[:4], "big")
    box = head[8:min(max(size, 16), len(head))]
    brands = [box[:4]] + [box[i:i + 4] for i in range(8, len(box) - 3, 4)]  # major, (minor version), compatible
    return next((_HEIF_BRANDS[b] for b in brands if b in _HEIF_BRANDS), None)


def _is_svg(head: bytes) -> bool:
    """Whether ``head`` opens an SVG document, after any byte-order mark, comment or doctype.

    Example:
        >>> _is_svg(b"<!-- made by hand -->\\n<svg width='1'/>"), _is_svg(b"GIF89a")
        (True, False)
    """
    text = head.removeprefix(b"\xef\xbb\xbf").lstrip()
    return text.startswith(b"<") and (b"<svg" in text or b"<!DOCTYPE svg" in text)


def _other_format(source: Path | bytes | io.IOBase, head: bytes) -> str | None:
    """The format of an image outside the allow-list (``head``: its first bytes), or ``None``
    when nothing knows it."""
    if head.removeprefix(b"\xef\xbb\xbf").lstrip().startswith(_DOCUMENTS) or _is_svg(head):
        return "a document (PDF, PostScript or SVG)"
    try:
        # header parsing only: no pixel is decoded and no plugin's external program runs
        with Image.open(io.BytesIO(source) if isinstance(source, bytes)
                        else source.open("rb") if _is_remote(source) else source) as im:
            return f"{im.format} ({im.format_description})" if im.format else None
    except Exception:  # noqa: BLE001 - not an image Pillow knows either: a corrupt file
        return None


def video_demuxer(head: bytes) -> str | None:
    """The FFmpeg demuxer for a video whose first bytes are ``head``, or ``None`` when they
    name no container of :data:`VIDEO_CONTAINERS`.

    Example:
        >>> video_demuxer(b"\\x00\\x00\\x00\\x18ftypmp42")
        'mov'
    """
    if head[4:8] in (b"ftyp", b"moov", b"mdat", b"wide", b"free", b"skip", b"pnot"):
        return "mov"
    if head.startswith(b"\x1a\x45\xdf\xa3"):
        return "matroska"
    if head.startswith(b"RIFF") and head[8:12] == b"AVI ":
        return "avi"
    if head[:1] == b"\x47" and (len(head) <= 188 or head[188:189] == b"\x47"):
        return "mpegts"
    if head.startswith(b"\x00\x00\x01\xba"):
        return "mpeg"
    if head.startswith(b"FLV"):
        return "flv"
    if head.startswith(b"OggS"):
        return "ogg"
    if head.startswith(b"\x30\x26\xb2\x75\x8e\x66\xcf\x11"):
        return "asf"
    if head.startswith((b"\x00\x00\x00\x01", b"\x00\x00\x01")):
        return "h264"
    return None


@dataclass(frozen=True, slots=True)
class ImageInfo:
    """Header facts about an image.

    Attributes:
        width, height: size as the model sees it (after EXIF orientation when applied).
        format: Pillow's format name (``JPEG``, ``PNG`` ...).
        orientation: the EXIF orientation tag (1 when absent); 5-8 swap width and height.
    """

    width: int
    height: int
    format: str
    orientation: int = 1


def resolve_media_path(path: str, media_root: Path) -> Path:
    """Resolve ``path`` under ``media_root``; refuse anything that escapes it.

    ``..`` components, absolute paths elsewhere and symlinks that point outside the
    root all raise ``path_outside_root``; a path that does not exist, or is not a file (a
    directory, a pipe), raises ``missing_media``.

    A path written with Windows separators (``imgs\\sub\\e.jpg``) names that file when no file
    has the name itself (on POSIX a backslash is a legal name character, so such a file wins);
    the ``/`` form then obeys the same rules (``..\\x.jpg`` is outside the root).
    """
    if not isinstance(media_root, Path):  # a bucket: storage.RemoteRoot resolves keys the same way
        return media_root.file(path)
    shown = path if len(path) <= 200 else f"{path[:200]}..."
    if "\x00" in path:
        raise SampleError("bad_record", f"media path {shown!r} holds a NUL byte, which no file name can")
    root = media_root.resolve()
    if path.startswith(BUCKET_URLS):
        raise SampleError("missing_media", f"media {shown!r} is a bucket URL but --media-root {str(root)!r} is a local "
                                           "directory; pass the bucket prefix holding it as --media-root, or download "
                                           "it under --media-root")
    candidate = Path(path)
    if not candidate.is_absolute():
        candidate = root / candidate
    try:
        resolved = Path(os.path.realpath(candidate))
        if resolved != root and root not in resolved.parents:
            raise SampleError("path_outside_root", f"media path {shown!r} resolves outside --media-root {str(root)!r}")
        if not resolved.is_file():
            if "\\" in path and os.sep == "/":
                return _resolve_backslashed(path, root, shown)
            if resolved.exists():  # a directory named like a file (``x.png/``), a pipe, a device
                what = "a directory" if resolved.is_dir() else "a pipe, socket or device"
                raise SampleError("missing_media", f"media path {shown!r} under --media-root {str(root)!r} is {what}, "
                                                   "not a file; name the media file itself")
            raise SampleError("missing_media", f"media file {shown!r} not found under --media-root {str(root)!r}")
    except (OSError, ValueError) as exc:  # a name too long, a loop of links, an undecodable name
        raise SampleError("missing_media", f"media file {shown!r} cannot be looked up under --media-root "
                                           f"{str(root)!r}: {getattr(exc, 'strerror', None) or exc}") from None
    return resolved


def _resolve_backslashed(path: str, root: Path, shown: str) -> Path:
    """:func:`resolve_media_path` of ``path`` with its backslashes read as separators; a
    ``missing_media`` error says what was tried and how to write the path."""
    posix = path.replace("\\", "/")
    try:
        return resolve_media_path(posix, root)
    except SampleError as err:
        if err.reason != "missing_media":
            raise
        raise SampleError("missing_media", f"media file {shown!r} not found under --media-root {str(root)!r}, nor "
                                           f"{posix[:200]!r}: the path uses Windows backslashes; write it with '/' "
                                           f"separators, relative to --media-root") from None


def recorded_media_path(path: str, resolved, media_root) -> str:
    """The name a tokenized row records for media ``path``, which :func:`resolve_media_path`
    resolved to ``resolved`` under ``media_root``: relative to the root, with ``/`` separators,
    so that the rows stay valid once the media move and pack or the reader is given the new root.

    A relative path is kept as written. An absolute path (a ``file://`` URI is read as one) is
    cut after the root: after the first of its directories that *is* the root, however it is
    spelled (the root as given, its real path, a link to it or the name it is mounted under),
    so the names under the root stay as written (``/data/coco/x.jpg`` with ``--media-root /data``
    is ``coco/x.jpg``). A path that reaches the root only through ``..`` or a link from outside it
    is named by the real path of the file it resolved to. Under a bucket root an ``s3://`` or
    ``gs://`` URL becomes its key under the root's prefix. Paths outside the root never get
    here: :func:`resolve_media_path` refused them (``path_outside_root``).

    Example:
        >>> import tempfile
        >>> root = Path(tempfile.mkdtemp())
        >>> (root / "coco").mkdir()
        >>> _ = (root / "coco" / "x.jpg").write_bytes(b"x")
        >>> full = str(root / "coco" / "x.jpg")
        >>> recorded_media_path(full, resolve_media_path(full, root), root)
        'coco/x.jpg'
        >>> recorded_media_path("coco/./x.jpg", resolve_media_path("coco/./x.jpg", root), root)
        'coco/./x.jpg'
    """
    if not isinstance(media_root, Path):  # a bucket: a URL under it becomes its key under the prefix
        if not _URL_START.match(path):  # what storage.RemoteRoot reads as a URL
            return path
        key, prefix = split_url(str(resolved))[2], media_root.key
        return key[len(prefix) + 1:] if prefix else key
    if not path.startswith("/"):
        return path
    root = os.path.realpath(media_root)
    prefix = root.rstrip("/") + "/"
    rest = None
    if path.startswith(prefix):  # the usual case: no shorter head of the path can be the root
        rest = path[len(prefix):].split("/")
    else:  # the root by another name: the first head of the path that resolves to it
        parts = path.split("/")
        for i in range(2, len(parts)):  # "/data", then "/data/coco", ... ("/" is the root only as "/")
            if os.path.realpath("/".join(parts[:i])) == root:
                rest = parts[i:]
                break
    if rest is not None:
        rest = [p for p in rest if p not in ("", ".")]  # "a//b" and "a/./b" are "a/b" on any file system
        if rest and ".." not in rest:
            return "/".join(rest)
    return Path(resolved).relative_to(root).as_posix()


class MediaPathResolver:
    """:func:`resolve_media_path` for many paths under one root, with the root and each
    directory's real path resolved once (packing embeds millions of files from a few
    directories; resolving every path component of every file cost more than reading it).

    A path whose last component is a regular file (not a link, not ``.``/``..``) resolves to
    its directory's real path joined with its name, which is what ``realpath`` returns for it;
    anything else (a link, a missing file, a path outside the root) goes through
    :func:`resolve_media_path` itself, so results and errors are the same.

    Example:
        >>> import tempfile
        >>> root = Path(tempfile.mkdtemp())
        >>> _ = (root / "a.jpg").write_bytes(b"x")
        >>> MediaPathResolver(root)("a.jpg") == resolve_media_path("a.jpg", root)
        True
    """

    #: Directories remembered at once (the memo is cleared when full).
    MAX_DIRS = 65536

    def __init__(self, media_root: Path) -> None:
        self.root = Path(media_root).resolve()
        self._root_s = str(self.root)
        self._prefix = self._root_s.rstrip(os.sep) + os.sep
        self._dirs: dict[str, str] = {}

    def _under_root(self, path: str) -> str | None:
        """``path``'s directory's real path joined with its name, or ``None`` when only
        :func:`resolve_media_path` can say (a ``.``/``..`` name, a directory outside the root)."""
        head, sep, name = path.rpartition(os.sep)  # string ops only: this runs once per embedded file
        if sep and not head:  # "/name": the file system's root, not --media-root
            head = os.sep
        if name in ("", ".", ".."):
            return None
        real = self._dirs.get(head)
        if real is None:
            if len(self._dirs) >= self.MAX_DIRS:
                self._dirs.clear()
            # an absolute head replaces the root in the join; "" is the root itself
            real = self._dirs[head] = os.path.realpath(os.path.join(self._root_s, head or "."))
        if not (real == self._root_s or real.startswith(self._prefix)):
            return None
        # os.path.join(real, name) for a name with no separator and a real path that ends in
        # one only when it is the file system's root: one concatenation, about 1.5 us less a file
        return real + os.sep + name if real != os.sep else os.sep + name

    def _regular(self, path: str) -> tuple[str, os.stat_result] | None:
        """``(real path, lstat)`` of ``path`` when it names a regular file under the root by the
        fast route (:meth:`_under_root`), else ``None``."""
        full = self._under_root(path)
        if full is None:
            return None
        try:
            st = os.lstat(full)
        except OSError:
            return None
        return (full, st) if stat.S_ISREG(st.st_mode) else None

    def __call__(self, path: str) -> Path:
        hit = self._regular(path)
        return Path(hit[0]) if hit is not None else resolve_media_path(path, self.root)

    def stat(self, path: str) -> os.stat_result:
        """``os.stat`` of the file ``path`` resolves to: one ``lstat`` when it is a regular file
        (for which ``lstat`` is ``stat``), else :func:`resolve_media_path`'s result and errors.

        Example:
            >>> import tempfile
            >>> root = Path(tempfile.mkdtemp())
            >>> _ = (root / "a.jpg").write_bytes(b"xyz")
            >>> MediaPathResolver(root).stat("a.jpg").st_size
            3
        """
        hit = self._regular(path)
        return hit[1] if hit is not None else resolve_media_path(path, self.root).stat()

    def with_stat(self, path: str) -> tuple[Path, os.stat_result]:
        """``(self(path), self.stat(path))`` with one ``lstat`` for a regular file: what
        ``tokenize`` records of each media file it probes.

        Example:
            >>> import tempfile
            >>> root = Path(tempfile.mkdtemp())
            >>> _ = (root / "a.jpg").write_bytes(b"xyz")
            >>> resolved, st = MediaPathResolver(root).with_stat("a.jpg")
            >>> resolved == resolve_media_path("a.jpg", root), st.st_size
            (True, 3)
        """
        hit = self._regular(path)
        if hit is not None:
            return Path(hit[0]), hit[1]
        resolved = resolve_media_path(path, self.root)
        return resolved, resolved.stat()

    def read(self, path: str) -> bytes:
        """The bytes of the file ``path`` resolves to: one ``open`` that refuses a link in the
        last component, one ``fstat`` of the open file, one ``read`` of its size.

        This is what ``self(path).read_bytes()`` returns (packing reads every embedded image
        this way; the ``Path`` objects, the separate ``lstat`` and the buffered reader cost
        more than the read). A link, a directory or anything not a regular file goes through
        :func:`resolve_media_path`, so results and errors are the same.

        Example:
            >>> import tempfile
            >>> root = Path(tempfile.mkdtemp())
            >>> _ = (root / "a.jpg").write_bytes(b"xyz")
            >>> MediaPathResolver(root).read("a.jpg")
            b'xyz'
        """
        full = self._under_root(path)
        if full is not None:
            try:
                fd = os.open(full, _READ_FLAGS)
            except OSError:  # a link (ELOOP), a missing file: the slow path names the problem
                fd = -1
            if fd >= 0:
                try:
                    st = os.fstat(fd)
                    if stat.S_ISREG(st.st_mode):
                        return _read_all(fd, st.st_size)
                finally:
                    os.close(fd)
        return resolve_media_path(path, self.root).read_bytes()


#: ``os.open`` flags for :meth:`MediaPathResolver.read`: no link followed in the last component;
#: no wait for a writer when the name is a FIFO (a regular file ignores ``O_NONBLOCK``; the
#: ``fstat`` that follows sends anything else to :func:`resolve_media_path`).
_READ_FLAGS = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NONBLOCK", 0)


def _read_all(fd: int, size: int) -> bytes:
    """``size`` bytes from ``fd`` (fewer if the file shrank meanwhile); one ``read`` when it
    returns them all, as it does for a regular file of the size ``fstat`` gave."""
    data = os.read(fd, size)
    if len(data) == size or not data:
        return data
    parts = [data]
    left = size - len(data)
    while left > 0:
        more = os.read(fd, left)
        if not more:
            break
        parts.append(more)
        left -= len(more)
    return b"".join(parts)


def _is_remote(source: object) -> bool:
    """Whether ``source`` is a media object in a bucket (``storage.RemoteFile``)."""
    return type(source).__name__ == "RemoteFile"


def _open_rb(source):
    """``source`` opened for reading: a local path with ``open``, a remote file with ranged reads."""
    return source.open("rb") if _is_remote(source) else open(source, "rb")


def _tail(source: Path | bytes | io.IOBase, n: int = _TAIL) -> tuple[bytes, int]:
    if isinstance(source, bytes):
        return source[-n:], len(source)
    if isinstance(source, io.IOBase):  # a local file already open (probe_image)
        size = os.fstat(source.fileno()).st_size
        source.seek(max(0, size - n))
        return source.read(), size
    size = source.stat().st_size
    with _open_rb(source) as fh:
        fh.seek(max(0, size - n))
        return fh.read(), size


def _size(source: Path | bytes | io.IOBase) -> int:
    """The size in bytes of a media file (bytes, a file already open, a path, a remote file)."""
    if isinstance(source, bytes):
        return len(source)
    if isinstance(source, io.IOBase):  # a local file already open (probe_image)
        return os.fstat(source.fileno()).st_size
    return source.stat().st_size


def _pixel_data_end(im: Image.Image) -> int | None:
    """The byte where the pixel data of an opened BMP or TIFF ends, by its header alone; ``None``
    when the header does not say (a run-length BMP, a TIFF without byte counts).

    A BMP stores uncompressed rows of a fixed stride (a multiple of 4 bytes) from an offset,
    and decoders need the last row's pixels but not its padding; a TIFF lists the offset and
    byte count of every strip (or tile) of its first image, the one loaders decode.

    Example:
        >>> buf = io.BytesIO()
        >>> Image.new("RGB", (5, 3)).save(buf, format="BMP")
        >>> _pixel_data_end(Image.open(buf)), len(buf.getvalue())   # 54-byte header, rows of 16 (15 + padding)
        (101, 102)
    """
    if im.format == "BMP":
        tile = im.tile[0] if len(im.tile) == 1 else None
        if tile is None or tile[0] != "raw" or len(tile[3]) < 2 or not isinstance(tile[3][1], int):
            return None  # run-length or embedded JPEG/PNG data: no fixed size
        (x0, y0, x1, y1), offset, stride = tile[1], tile[2], tile[3][1]
        width, height = x1 - x0, abs(y1 - y0)
        # the bits per pixel are not kept after the header parse: the least the stride allows
        row = min(((width * bits + 7) // 8 for bits in (1, 2, 4, 8, 16, 24, 32, 64)
                   if ((width * bits + 31) >> 3) & ~3 == stride), default=stride)
        return offset + stride * (height - 1) + row if height else offset
    if im.format == "TIFF":
        tags = im.tag_v2
        for offsets_tag, counts_tag in ((273, 279), (324, 325)):
            offsets, counts = tags.get(offsets_tag), tags.get(counts_tag)
            if offsets is None or counts is None:
                continue
            offsets = offsets if isinstance(offsets, tuple) else (offsets,)
            counts = counts if isinstance(counts, tuple) else (counts,)
            if len(offsets) != len(counts) or not offsets:
                return None
            return max(int(o) + int(c) for o, c in zip(offsets, counts, strict=True))
    return None


def _whole(source: Path | bytes | io.IOBase) -> bytes:
    if isinstance(source, bytes):
        return source
    if isinstance(source, io.IOBase):
        source.seek(0)
        return source.read()
    with _open_rb(source) as fh:
        return fh.read()


#: ``FF`` fill bytes: a marker is the byte after a run of them, unless it is a stuffed ``00``, a
#: restart ``D0``-``D7`` or ``TEM`` (``01``), none of which ends a scan.
_FF_RUN = re.compile(rb"\xff+")
_NOT_MARKERS = frozenset((0x00, 0x01, *range(0xD0, 0xD8)))


def _jpeg_marker(data: bytes, i: int) -> tuple[int, int] | None:
    """``(marker byte, offset past it)`` of the first marker at or after ``i``, or ``None``.

    Linear in the bytes looked at: each run of ``FF`` is crossed once. (A regular expression
    ``FF+`` followed by a marker byte retried every start inside a run that no marker ends, so a
    file ending in a long fill of ``FF``, as a recovered or preallocated one may, took time
    quadratic in the run: 13 s for 40 KB.)
    """
    n = len(data)
    while (j := data.find(b"\xff", i)) >= 0:
        k = _FF_RUN.match(data, j).end()
        if k >= n:
            return None
        if data[k] not in _NOT_MARKERS:
            return data[k], k + 1
        i = k + 1
    return None


def _jpeg_end(data: bytes) -> int | None:
    """The offset just past a JPEG's end-of-image marker, found by walking its segments from the
    start, or ``None`` when the file ends first (truncated).

    Marker segments are skipped by their lengths, so an ``FFD9`` inside one (the end of an EXIF
    thumbnail) is not taken for the end; entropy-coded scan data runs to the next marker.

    Example:
        >>> _jpeg_end(b"\\xff\\xd8\\xff\\xe0\\x00\\x04\\xff\\xd9\\xff\\xda\\x00\\x02\\x12\\xff\\x00\\xff\\xd9MP4...")
        17
    """
    if not data.startswith(b"\xff\xd8"):
        return None
    i = 2
    while (m := _jpeg_marker(data, i)) is not None:
        marker, i = m
        if marker == 0xD9:
            return i
        if i + 2 > len(data):
            return None
        i += int.from_bytes(data[i : i + 2], "big")  # the length counts its own two bytes
    return None


def verify_complete(source: Path | bytes | io.IOBase, fmt: str, data_end: int | None = None) -> None:
    """Cheap truncation check from the file's tail (no decode).

    JPEG must end with the end-of-image marker ``FFD9`` (zero padding after it is allowed), or
    else (a phone's motion photo, an MP4 appended after the picture) its segments, walked from
    the start, must reach one: bytes after it are tolerated, as decoders do. An ``FFD9``
    elsewhere in the tail proves nothing: an EXIF thumbnail or an ICC profile holds one
    inside its segment, so a file cut just after them is truncated. PNG needs an ``IEND``
    chunk, GIF ends with the ``;`` trailer, WebP's RIFF size must fit the file. BMP and
    TIFF have no end marker: the pixel data their header places (``data_end``, see
    :func:`_pixel_data_end`; read from the header when not given) must fit the file.

    Raises:
        SampleError: ``corrupt_image`` naming what is missing.
    """
    fmt = fmt.upper()
    if fmt in ("BMP", "TIFF"):
        if data_end is None:
            with open_image(source) as im:
                data_end = _pixel_data_end(im)
        size = _size(source)
        if data_end is not None and data_end > size:
            raise SampleError("corrupt_image", f"truncated {fmt}: its header places pixel data up to byte "
                                               f"{data_end:,}, the file has {size:,} bytes")
        return
    if fmt not in ("JPEG", "MPO", "PNG", "GIF", "WEBP"):
        return
    tail, size = _tail(source)
    if fmt in ("JPEG", "MPO") and not tail.rstrip(b"\x00").endswith(b"\xff\xd9") and _jpeg_end(_whole(source)) is None:
        raise SampleError("corrupt_image", f"truncated JPEG: no end-of-image marker ends its image data ({size:,} bytes)")
    if fmt == "PNG" and b"IEND" not in tail[-64:]:
        raise SampleError("corrupt_image", f"truncated PNG: no IEND chunk at the end of {size:,} bytes")
    if fmt == "GIF" and not tail.rstrip(b"\x00").endswith(b";"):
        raise SampleError("corrupt_image", f"truncated GIF: no trailer at the end of {size:,} bytes")
    if fmt == "WEBP":
        head = _head(source, 12)
        riff = int.from_bytes(head[4:8], "little") + 8
        if riff > size:
            raise SampleError("corrupt_image", f"truncated WebP: RIFF header says {riff:,} bytes, file has {size:,}")


#: PNG chunks whose data Pillow reads into an image's EXIF (``eXIf``; a text chunk may hold
#: ``Raw profile type exif`` or XMP with a ``tiff:Orientation``).
_PNG_METADATA = (b"eXIf", b"tEXt", b"zTXt", b"iTXt")


def _png_metadata_after_pixels(source: Path | bytes | io.IOBase) -> bool:
    """Whether a PNG has a metadata chunk (:data:`_PNG_METADATA`) after its image data, found
    by walking the chunk headers (the pixel data is skipped by its lengths, never read). A file
    already open (the one :func:`probe_image` reads the header from) is walked from its start
    and left where it was.

    Example:
        >>> buf = io.BytesIO()
        >>> Image.new("L", (4, 4)).save(buf, format="PNG")
        >>> _png_metadata_after_pixels(buf.getvalue())
        False
    """
    if isinstance(source, io.IOBase):
        at = source.tell()
        try:
            return _png_walk(source)
        finally:
            source.seek(at)
    fh = io.BytesIO(source) if isinstance(source, bytes) else (
        source.open("rb") if _is_remote(source) else open(source, "rb", buffering=0))
    with fh:
        return _png_walk(fh)


def _png_walk(fh) -> bool:
    """:func:`_png_metadata_after_pixels` on an open file, from its first chunk."""
    fh.seek(8)
    pixels = False
    while len(head := fh.read(8)) == 8 and head[4:8] != b"IEND":
        kind = head[4:8]
        if kind in (b"IDAT", b"fdAT"):
            pixels = True
        elif pixels and kind in _PNG_METADATA:
            return True
        fh.seek(int.from_bytes(head[:4], "big") + 4, io.SEEK_CUR)  # the data and its CRC
    return False


def _exif_of(im: Image.Image, source: Path | bytes | io.IOBase) -> Image.Exif:
    """``im.getexif()`` without decoding the pixels where Pillow would: a PNG with no EXIF before
    its image data is loaded whole to look for one after it, which the chunk walk of
    :func:`_png_metadata_after_pixels` answers from the chunk headers. What the header gave
    (``eXIf``, text chunks, XMP) is read as ``getexif`` reads it."""
    if im.format == "PNG" and "exif" not in im.info and not _png_metadata_after_pixels(source):
        return Image.Image.getexif(im)
    return im.getexif()


def probe_image(source: Path | bytes, exif: str = "ignore", verify: bool = True) -> ImageInfo:
    """Read an image's size from its header (no pixel decode).

    Args:
        source: a file path or the image bytes.
        exif: ``"apply"`` reports the size after EXIF orientation (5-8 swap width and
            height, as ``ImageOps.exif_transpose`` would); ``"ignore"`` the stored size.
        verify: run :func:`verify_complete` on the file's tail.

    Example:
        A 640x480 JPEG whose EXIF orientation is 6 (rotate 90) probes as 480x640 with
        ``exif="apply"`` and 640x480 with ``exif="ignore"``.

    Raises:
        SampleError: ``corrupt_image`` when the header is unreadable or the file is
            truncated, ``image_too_large`` when the declared size passes Pillow's
            decompression-bomb limit (the limit stays on).
    """
    if not isinstance(source, Path):
        return _probe_open(source, exif, verify)
    # a local file is opened once for the header and the tail check: an open costs about as
    # much as Pillow's header parse on a small file, and a corpus of distinct images pays it per image
    try:
        fh = open(source, "rb")  # what Image.open does with a path, and fails with the same words
    except OSError as exc:
        raise _unreadable_header(exc) from None
    with fh:
        return _probe_open(fh, exif, verify)


def _unreadable_header(exc: Exception) -> SampleError:
    """The row's error for an image whose header cannot be opened or parsed."""
    return SampleError("corrupt_image", f"cannot read image header: {type(exc).__name__}: {str(exc)[:200]}")


def _probe_open(fh: Path | bytes | io.IOBase, exif: str, verify: bool) -> ImageInfo:
    """:func:`probe_image` on ``fh``: a local file opened, or the source itself (bytes, a remote file)."""
    try:
        with warnings.catch_warnings():
            # Pillow's words on damaged EXIF or TIFF tags ("Corrupt EXIF data", "Tag data larger
            # than file") went to stderr in the middle of a run: the row's outcome says what counts
            warnings.simplefilter("ignore", UserWarning)
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            with open_image(fh) as im:
                width, height = im.size
                fmt = im.format or ""
                orientation = 1
                # exif_transpose also reads an XMP tiff:Orientation when there is no EXIF (Adobe exports)
                if exif == "apply" and ("exif" in im.info or "xmp" in im.info or fmt in ("TIFF", "MPO", "WEBP", "PNG")):
                    try:
                        orientation = int(_exif_of(im, fh).get(_EXIF_ORIENTATION, 1) or 1)
                    except (ValueError, TypeError, SyntaxError, OSError):
                        orientation = 1  # unreadable EXIF: loaders ignore it too
                upright = fmt == "TIFF" and (width, height) != (im.tag_v2.get(256), im.tag_v2.get(257))
                data_end = _pixel_data_end(im) if verify else None
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
        # Pillow's own words name twice the limit past which it refuses outright, beside the limit
        # past which it warns (both refused here): the image's size alone, against the limit
        declared = re.search(r"\((\d+) pixels\)", str(exc))
        size = f"of {int(declared.group(1)):,} px " if declared else ""
        raise SampleError(
            "image_too_large", f"image {size}exceeds Pillow's decompression-bomb limit ({Image.MAX_IMAGE_PIXELS:,} px), "
                               "past which packtool refuses an image (Pillow warns, and refuses from twice the limit)"
        ) from None
    except SampleError:
        raise
    except Image.UnidentifiedImageError:  # its message holds the file object's address: not deterministic
        raise SampleError("corrupt_image", "cannot read image header: not an image Pillow can identify") from None
    except Exception as exc:  # noqa: BLE001 - any header parser failure on hostile bytes is this row's
        raise _unreadable_header(exc) from None
    if width <= 0 or height <= 0:
        raise SampleError("corrupt_image", f"image declares a zero size ({width}x{height})")
    if verify:
        verify_complete(fh, fmt, data_end)
    # recent Pillow opens a TIFF already turned upright (its size is the upright one), loader or not
    if orientation in (5, 6, 7, 8) and not upright:
        width, height = height, width
    return ImageInfo(width, height, fmt, orientation)


def _open_video(source: Path | bytes | str):
    import av

    if isinstance(source, bytes):
        head = source[:189]
    else:
        try:
            with _open_rb(source) as fh:
                head = fh.read(189)
        except OSError as exc:
            raise SampleError("corrupt_video", f"cannot open video: {exc.strerror}") from None
    demuxer = video_demuxer(head)
    if demuxer is None:
        raise SampleError("unsupported_media", f"not a video container packtool reads ({VIDEO_CONTAINERS}); "
                                               "convert the file, e.g. to MP4")
    try:
        if isinstance(source, bytes):
            return av.open(io.BytesIO(source), format=demuxer)
        # a remote file: PyAV reads it as a file object, each read one ranged GET of what it asks for
        return av.open(source.open("rb") if _is_remote(source) else str(source), format=demuxer)
    except (av.error.FFmpegError, OSError, ValueError) as exc:
        raise SampleError("corrupt_video", f"cannot open video: {_av_reason(exc)}") from None


def _check_boxes(source: Path | bytes | str) -> None:
    """``corrupt_video`` when an MP4/MOV file's top-level boxes do not fit in it: a file cut short
    (a download that stopped, a copy interrupted) whose last box, usually ``mdat`` or ``moov``,
    says it is longer than what is left. FFmpeg opens such a file from its headers and tokenize
    counted it, but its frames do not all decode, and pack stopped on it. Reads eight or sixteen
    bytes a box, never the boxes themselves (a fragmented file has two boxes a fragment).

    Raises:
        SampleError: ``corrupt_video`` naming the box and the bytes missing.
    """
    with io.BytesIO(source) if isinstance(source, bytes) else _open_rb(source) as fh:
        size = fh.seek(0, io.SEEK_END)
        at = 0
        while at + 8 <= size:
            fh.seek(at)
            head = fh.read(16)
            n, kind = int.from_bytes(head[:4], "big"), head[4:8]
            if n == 1 and len(head) == 16:  # a 64-bit size follows the type
                n = int.from_bytes(head[8:16], "big")
            elif n == 0:  # the box runs to the end of the file
                return
            if n < 8:
                return  # not a box size: FFmpeg judged the file; this check has nothing to add
            if at + n > size:
                name = kind.decode("latin-1") if kind.isascii() and kind.isalnum() else kind.hex()
                raise SampleError("corrupt_video", f"truncated file: its {name!r} box needs {at + n - size:,} bytes "
                                                   f"more than the {size:,} the file has")
            at += n


def _av_reason(exc: BaseException) -> str:
    """What FFmpeg (or the OS) said, without the errno number and the stream name PyAV wraps
    it in (``[Errno 1094995529] Invalid data found when processing input: '<none>'``): the row
    names the file already.

    Example:
        >>> _av_reason(OSError(5, "Input/output error")), _av_reason(ValueError("bad"))
        ('Input/output error', 'bad')
    """
    text = getattr(exc, "strerror", None)
    return text if isinstance(text, str) and text else str(exc)


def _display_rotation(container, stream) -> int:
    """Display rotation (degrees counterclockwise, as FFmpeg's display matrix: 0/90/180/270).

    MP4/MOV carry it as a display matrix that PyAV exposes on decoded frames only,
    so for those containers the first frame is decoded (the one decode a probe
    does); other containers rarely carry rotation and are reported as 0.
    """
    if not any(n in container.format.name for n in ("mov", "mp4")):
        return 0
    try:
        for frame in container.decode(stream):
            return int(round(frame.rotation or 0)) % 360
    except Exception:  # noqa: BLE001 - a broken first frame is found later by pack
        return 0
    return 0


def _steady_rate(stream) -> bool:
    """Whether an MP4/MOV stream's average rate is its base rate: a constant-rate stream,
    whose frame ``i`` is at ``i / fps`` (a variable-rate one has a base rate of its
    shortest frame gap, well above the average)."""
    avg, base = stream.average_rate, stream.guessed_rate or stream.base_rate
    return bool(avg and base) and abs(float(avg) - float(base)) <= 1e-3 * float(base)


def _demux_frames(container, stream, tb: float) -> tuple[int, list[float] | None, float]:
    """``(frames, times, end)`` of the video stream by demuxing packet headers (no decode).

    ``frames`` counts packets that hold data (one coded frame each, as decord, torchcodec
    and a full decode count them), but not those the container marks to be discarded (the
    frames before the start of an MP4 cut without re-encoding, which its edit list hides and a
    decode drops); ``times`` are their presentation times in seconds,
    sorted (``None`` when a packet carries none: a raw stream); ``end`` is the end of
    the last frame (``pts + duration``).
    """
    count, times, end = 0, [], 0.0
    for pkt in container.demux(stream):
        if pkt.size == 0 or pkt.is_discard:
            continue
        count += 1
        if pkt.pts is None:
            times = None
            continue
        end = max(end, (pkt.pts + (pkt.duration or 0)) * tb)
        if times is not None:
            times.append(pkt.pts * tb)
    if times is not None:
        times.sort()
    return count, times, end


def _shown_duration(times: list[float], end: float, headers: list[float], fps: float, tick: float) -> float:
    """How long demuxed frames are shown, from the first frame's start to the last frame's end:
    the duration a decode sees (its frame times count from the first frame).

    ``times`` are the frames' presentation times (seconds, sorted), ``end`` the end of the last
    packet (:func:`_demux_frames`) and ``tick`` the stream's clock tick. A header duration
    (``headers``: the stream's, then the container's) is read as a span or as an end time counted
    from zero, which is what a Matroska or ASF header and some FLV muxers store (the start offset
    included), and taken when it ends the last frame: within two ticks of ``end`` where the packets
    store their durations (Matroska, WebM; theirs are cut to the tick), within one frame gap after
    its start where they do not (FLV, AVI, ASF, MPEG-PS). Else the packets' end, or one frame at
    ``fps`` (the stream's rate) after the last (an MPEG-PS duration is a guess from the bit rate,
    a container's may be a longer audio track's).

    Example:
        >>> _shown_duration([2.0, 2.5, 3.0], 3.0, [3.5], 2.0, 0.001)  # the header counts the 2 s before the first frame
        1.5
    """
    first, last = times[0], times[-1]
    shown = last - first
    gaps = sorted(b - a for a, b in zip(times, times[1:], strict=False) if b > a)
    frame = 1 / fps if fps > 0 else gaps[len(gaps) // 2] if gaps else 0.0
    slack = max(frame, gaps[-1] if gaps else 0.0) + tick
    for header in headers:
        for span in (header, header - first):
            if (abs(span - (end - first)) <= 2 * tick if end > last else shown < span <= shown + slack):
                return span
    return end - first if end > last else shown + frame


def probe_video(source: Path | bytes | str, apply_rotation: bool = False) -> VideoMeta:
    """Duration, frame rate, frame count, start time and rotation of a video, without decoding.

    The frame count is what a frame-indexed reader (decord, torchcodec, a full decode)
    counts. MP4/MOV store it with every frame's time; a constant-rate MP4 is read from
    its headers alone (unless its count is not its duration's: a cut whose edit list hides
    frames, which are not counted). Other containers (Matroska/WebM, MPEG-TS, FLV, AVI, ...) store no
    count, or one that counts dropped frames, so their packet headers are demuxed: one
    pass over the file, no decode. A variable-rate MP4 is demuxed too.

    * fps: the stream's average rate (guessed rate, base rate when absent); for a
      variable-rate stream, frames over the time from the first frame to the end of the
      last (the headers' rate of a Matroska or TS stream is a nominal one);
    * duration: from the first frame's start to the last frame's end, as a decode sees it:
      an MP4's from its headers (stream, then container duration), a demuxed file's from its
      packets (:func:`_shown_duration`: a Matroska or ASF header counts the start offset, an
      MPEG-PS one is a bitrate guess); a raw stream's is frames / rate;
    * frame times (:attr:`VideoMeta.frame_times`): recorded only when some frame ``i``
      is further than one tick of the stream's clock (at least 1 ms) from ``i / fps``,
      so that a family that samples frames by index records the times they are shown at.

    ``start_s`` is the first frame's presentation time (non-zero in many TS files);
    frame times recorded by a family are relative to it.

    Example:
        A 30 s, 30 fps, 1280x720 MP4 probes as
        ``VideoMeta(1280, 720, 30.0, 30.0, 900, 0.0, 0)``; a Matroska file of 20 frames
        shown at irregular times over 2.033 s probes as 20 frames at 9.84 fps with
        the 20 frame times.

    Raises:
        SampleError: ``corrupt_video`` when the file cannot be opened or has no video stream.
    """
    import av

    container = _open_video(source)
    try:
        if "mov" in container.format.name and not _is_remote(source):
            _check_boxes(source)
        if not container.streams.video:
            raise SampleError("corrupt_video", "file has no video stream")
        stream = container.streams.video[0]
        cc = stream.codec_context
        if cc is None:  # a header cut or damaged before the stream's codec is described
            raise SampleError("corrupt_video", "video stream names no codec FFmpeg knows (a truncated or damaged header)")
        width, height = int(cc.width or 0), int(cc.height or 0)
        if width <= 0 or height <= 0:
            raise SampleError("corrupt_video", f"video stream declares no frame size ({width}x{height})")
        rate = stream.average_rate or stream.guessed_rate or stream.base_rate
        fps = float(rate) if rate else 0.0
        tb = float(stream.time_base) if stream.time_base else 0.0
        start = stream.start_time * tb if stream.start_time is not None and tb else None
        if start is None:
            start = container.start_time / av.time_base if container.start_time is not None else 0.0
        headers = []  # the header durations, the stream's first
        if stream.duration and tb:
            headers.append(stream.duration * tb)
        if container.duration:
            c_start = container.start_time / av.time_base if container.start_time is not None else 0.0
            headers.append(container.duration / av.time_base - (start - c_start))
        duration = headers[0] if headers else None
        n_frames = int(stream.frames or 0)
        mov = any(n in container.format.name for n in ("mov", "mp4"))
        # only MP4/MOV carry rotation (and always a duration); read before a demux moves to the end
        rotation = _display_rotation(container, stream) if mov and stream.duration else 0
        frame_times: tuple[float, ...] = ()
        # the header's count is every stored frame: an MP4 cut without re-encoding stores frames
        # before its start that its edit list hides (its duration is the cut's), so it is demuxed too
        shown = duration is not None and abs(n_frames - duration * fps) <= 1
        if not (mov and n_frames > 0 and _steady_rate(stream) and shown):
            if mov and stream.duration:
                container.seek(0, stream=stream)  # the rotation read decoded the first frame
            count, times, end = _demux_frames(container, stream, tb)
            if count:
                n_frames = count
            if times:
                first = times[0]
                tick = max(tb, 1e-3)
                if not mov:  # headers that count a start offset, or guess (MP4's are exact)
                    duration = _shown_duration(times, end, headers, fps, tick)
                elif duration is None:
                    duration = end - first
                if fps <= 0 or any(abs(t - first - i / fps) > tick for i, t in enumerate(times)):
                    frame_times = tuple(t - first for t in times)
                    span = duration if not mov else end - first if end > first else duration
                    if span and span > 0:
                        fps = count / span
        if not duration and n_frames and fps > 0:
            duration = n_frames / fps  # raw streams carry no timing at all
        if fps <= 0 and duration and n_frames:
            fps = n_frames / duration
    except SampleError:
        raise
    except (av.error.FFmpegError, OSError, ValueError) as exc:
        raise SampleError("corrupt_video", f"cannot read video headers: {_av_reason(exc)}") from None
    finally:
        container.close()
    if apply_rotation and rotation in (90, 270):
        width, height = height, width
    return VideoMeta(width, height, float(duration or 0.0), fps, n_frames, float(start), rotation, frame_times)


def _encode_jpeg(img: Image.Image, quality: int) -> bytes:
    buf = io.BytesIO()
    (img if img.mode == "RGB" else img.convert("RGB")).save(buf, format="JPEG", quality=quality)
    return buf.getvalue()


def extract_frames(media_root: Path, media: dict, quality: int = 90, rotate: bool | None = None) -> list[bytes]:
    """JPEG bytes of the frames a tokenized video entry recorded (``media["timestamps"]``).

    The frames are those of :func:`counted_frames` (``rotate``: whether tokenize applied the
    display rotation, its family's ``exif`` setting), which the trainer-side reader also
    uses for videos packed by reference, so both media modes feed a model the same frames.
    A frame taken for several times (a repeated time, or times past the end) is encoded once.

    Example:
        For a 30 fps clip and timestamps ``[0.0, 0.5]`` this returns the JPEGs of
        frames 0 and 15.
    """
    if not media.get("timestamps"):
        return []
    data = media.get("data")
    source = data if data is not None else resolve_media_path(media.get("path") or "", media_root)
    jpegs: dict[int, bytes] = {}  # by image: the list holds every image, so no id is reused
    for img in (images := counted_frames(source, media, rotate)):
        if id(img) not in jpegs:
            jpegs[id(img)] = _encode_jpeg(img, quality)
    return [jpegs[id(img)] for img in images]


def counted_frames(source: Path | bytes, media: dict, rotate: bool | None = None) -> list[Image.Image]:
    """The frames of the video ``source`` at the times a tokenized entry recorded (``media["timestamps"]``).

    Frame ``t`` is the frame on screen at ``start + t``: the last frame whose
    presentation time is at or before it, to one tick of the stream's clock (times
    past the end give the last frame).
    Dense requests (on average less than 2 s apart) are served by one linear decode;
    sparse ones seek to the keyframe before each time and decode forward. Only the frames
    taken are turned into images. Where the codec and container allow (:func:`_skip_depth`),
    the decoder skips the frames that no time takes and no other frame is predicted from
    (:func:`_frames_skipping`), and a time whose seek lands where the previous time's did is
    read on from that decode (:class:`_Runs`); the frames are those of a plain decode, which
    is what runs wherever the stream is not what that plan takes it for.

    ``rotate`` says whether tokenize applied the stream's display rotation (its family's
    ``exif`` setting is ``apply``): the frames are then turned upright by it, 90, 180 or 270
    degrees, as the row's size was counted. ``None`` (a caller that does not know the
    setting) turns them only where the row's width and height are the coded size swapped,
    which misses a 180 degree turn and any turn of a square video.

    Raises:
        SampleError: the file is not a readable video, has no frame at a recorded time, or its
            frames taken are not all one size (``corrupt_video``: a stream whose size changes).
    """
    times = list(media.get("timestamps") or [])
    if not times:
        return []
    container = _open_video(source)
    try:
        try:
            out, rotation, swapped = _frames_at(container, source, times, media, skip=True)
        except _PlanBroken:
            # the skipping decode met what its plan does not cover: the same steps again from a
            # fresh file, every frame decoded
            container.close()
            container = _open_video(source)
            out, rotation, swapped = _frames_at(container, source, times, media, skip=False)
    except SampleError:
        raise
    except Exception as exc:  # noqa: BLE001 - any decoder failure is a corrupt video for this row
        raise SampleError("corrupt_video", f"cannot decode frames: {_av_reason(exc)}") from None
    finally:
        container.close()
    if any(img is None for img in out):
        raise SampleError("corrupt_video", "video has no decodable frame at a recorded time")
    first_at: dict[tuple[int, int], float] = {}
    for t, img in zip(times, out, strict=True):
        first_at.setdefault(img.size, t)  # type: ignore[union-attr]
    if len(first_at) > 1:
        # tokenize counted the size its headers give; a model's processor stacks a video's frames
        # into one tensor, and the reader did so too, failing with a bare shape error in training
        seen = ", ".join(f"{w}x{h} at {t:g} s" for (w, h), t in sorted(first_at.items(), key=lambda x: x[1]))
        raise SampleError("corrupt_video", f"its frame size changes mid-stream ({seen}), and a model's processor takes "
                                           "a video's frames at one size; re-encode it at one size")
    if rotate is not None:
        recorded = (media.get("width"), media.get("height"))
        # the turn tokenize counted: a frame turned by it has the recorded size (a square video
        # and a half turn keep it; a quarter turn of another video swaps it, which probe_video did)
        turned = out[0].size[::-1] if rotation in (90, 270) else out[0].size  # type: ignore[union-attr]
        swapped = rotate and rotation in _ROTATE and (None in recorded or turned == recorded)
    if swapped and rotation in _ROTATE:
        upright: dict[int, Image.Image] = {}  # one turn per frame taken, however many times take it
        for img in out:
            if id(img) not in upright:
                upright[id(img)] = img.transpose(_ROTATE[rotation])  # type: ignore[union-attr]
        out = [upright[id(img)] for img in out]
    return out  # type: ignore[return-value]


#: Demuxers whose frame times FFmpeg makes up in decode order (AVI stores none; ASF's are read as
#: decode times): a stream with B-frames is read by position (:func:`_frames_at`), where the
#: frames' own times are out of order (ASF's old demuxer, ``asf_o``, included should one be used).
_DECODE_ORDER_TIMES = ("avi", "asf", "asf_o")
#: MPEG program and transport streams: a frame may carry no time (H.264 in MPEG-PS: most packets
#: have none) or one out of order, and a seek lands on any packet, not a keyframe. They are read in
#: one pass (:func:`_frames_at`), a transport stream seeking only where its codec is one of
#: :data:`_KEYFRAME_START`.
_MPEG_STREAMS = ("mpeg", "mpegts")
#: Decoders that put out nothing before the first keyframe they are given (an MPEG-4 Part 2 decoder
#: puts out the frames after a seek rebuilt from nothing, which appear nowhere in a full decode).
_KEYFRAME_START = ("h264", "hevc", "mpeg1video", "mpeg2video")


def _frames_at(container, source: Path | bytes, times: list[float], media: dict,
               skip: bool) -> tuple[list[Image.Image | None], int, bool]:
    """``(frames, rotation, rotate)`` of :func:`counted_frames` from the open ``container`` (of
    ``source``): the frame taken for each time (``None`` where there is none), the display rotation
    of the first frame, and whether the row recorded the rotated size. ``skip`` lets the decoder
    skip frames (:func:`_frames_skipping`) where :func:`_skip_depth` allows it; a sparse request
    then opens ``source`` a second time, to learn where each seek lands (:class:`_Runs`).

    Raises:
        _PlanBroken: ``skip`` was given and the stream is not what the skipping decode takes it
            for (or its decoder failed); :func:`counted_frames` then runs this again on a fresh
            file without it.
    """
    import av

    stream = container.streams.video[0]
    tb = float(stream.time_base)
    cc = stream.codec_context
    rotate = (media.get("width"), media.get("height")) == (cc.height, cc.width) and cc.width != cc.height
    order = sorted(range(len(times)), key=lambda i: times[i])
    # a raw H.264 stream carries no frame times: frame n is at n / rate, as probe_video counted it
    # (and nothing to seek by, so it is always decoded in one pass)
    fmt = container.format.name
    raw = fmt == "h264"
    rate = float(stream.average_rate or stream.guessed_rate or stream.base_rate or 0) if raw else 0.0
    # AVI stores no presentation times, and FFmpeg reads those of an ASF file as decode times: in
    # both it makes them up in decode order, so a stream with B-frames comes out of the decoder in
    # display order with its times out of order (or none: H.264 in ASF); the n-th frame decoded is
    # the one shown at the n-th packet time, as probe_video counted it (and the times a seek lands
    # on say nothing, so it is decoded in one pass)
    shown_at = None
    if fmt in _DECODE_ORDER_TIMES and cc.has_b_frames:
        shown_at = _demux_frames(container, stream, tb)[1]
        container.seek(0, stream=stream)
    # an MPEG-PS seek is never taken, nor an MPEG-TS one where the decoder does not wait for a keyframe
    one_pass = fmt == "mpeg" or (fmt == "mpegts" and cc.name not in _KEYFRAME_START)
    dense = (raw or bool(shown_at) or one_pass or len(times) < 2 or
             (max(times) - min(times)) / (len(times) - 1) < 2.0)
    # in an MPEG program or transport stream read in one pass, frame n is at n / rate where a packet
    # has no time (probe_video counted so), else at its own time, or the n-th packet time where
    # it has none or one not after the frame before's
    packet_times = None
    if dense and fmt in _MPEG_STREAMS:
        headers = _open_video(source)  # a second handle: a seek back to the start may land after it
        try:
            packet_times = _demux_frames(headers, headers.streams.video[0], tb)[1]
        finally:
            headers.close()
        if packet_times is None:
            rate = float(stream.average_rate or stream.guessed_rate or stream.base_rate or 0)
    # a frame time is rounded to its stream's clock: Matroska, WebM and FLV count milliseconds, so
    # frame 20 of a 30 fps clip is stored at 0.667 s, after the 0.6667 s it stands for; within one
    # tick (at most 1 ms) a frame is at the recorded time, else the frame before it was taken
    eps = max(1e-6, min(tb, 1e-3))
    depth = _skip_depth(container, stream, seeking=not dense) if skip else None
    try:
        if dense:
            out, rotation = _dense_frames(container, stream, times, order, eps, depth, rate, shown_at, packet_times)
        else:
            out, rotation = _sparse_frames(container, source, stream, times, order, eps, depth)
    except av.error.FFmpegError:
        if depth is None:
            raise
        raise _PlanBroken("a decoder error, which a plain decode may meet elsewhere") from None
    return out, rotation, rotate


def _dense_frames(container, stream, times: list[float], order: list[int], eps: float, depth: int | None,
                  rate: float, shown_at: list[float] | None,
                  packet_times: list[float] | None = None) -> tuple[list[Image.Image | None], int]:
    """The frames of a dense request, from one decode of the whole stream (that skips frames
    where ``depth`` is given), and the first frame's rotation (``rate``, ``shown_at`` and
    ``packet_times``: :func:`_plain_times`)."""
    tb = float(stream.time_base)
    if depth is not None:
        frames = _frames_skipping(container, stream, [times[i] for i in order], eps, depth)
        timed = ((frame.pts * tb, frame) for frame in frames)
    else:
        frames = container.decode(stream)
        timed = _plain_times(frames, tb, rate, shown_at, packet_times)
    try:
        return _pick_dense(timed, times, order, eps)
    finally:
        frames.close()  # a skipping decode hands the decoder back as it found it


def _sparse_frames(container, source: Path | bytes, stream, times: list[float], order: list[int], eps: float,
                   depth: int | None) -> tuple[list[Image.Image | None], int]:
    """The frames of a sparse request, one seek per time (decodes that skip frames and go on from
    one another where ``depth`` is given, :class:`_Runs`), and the first frame's rotation."""
    tb = float(stream.time_base)
    first, rotation = None, 0
    for frame in container.decode(stream):
        first, rotation = frame.pts * tb, int(round(frame.rotation or 0)) % 360
        break
    out: list[Image.Image | None] = [None] * len(times)
    runs = probe = None
    try:
        if depth is not None:
            probe = _open_video(source)
            runs = _Runs(container, stream, probe, [times[i] for i in order], first, eps, depth)
        for i in order:
            out[i] = _frame_on_screen(container, stream, times[i], first, eps, runs, source)
    finally:
        if runs is not None:
            runs.close()
        if probe is not None:
            probe.close()
    return out, rotation


def _plain_times(frames, tb: float, rate: float, shown_at: list[float] | None,
                 packet_times: list[float] | None = None):
    """``(time, frame)`` of each frame a plain decode gives: ``n / rate`` for a raw stream or an
    MPEG-PS/TS one whose packets lack times (``rate`` above 0), the n-th packet time for an AVI or
    ASF with B-frames (``shown_at``), else the frame's own presentation time. Frames without one
    are left out, except in an MPEG-PS/TS stream (``packet_times``: its packet times, sorted),
    where a frame without one, or with one not after the frame before's (the last MPEG-4 frame
    of an MPEG-PS file), is at the n-th packet time where that is after it, and left out else."""
    last = None
    for n, frame in enumerate(frames):
        if rate > 0:
            t = n / rate
        elif shown_at:
            t = shown_at[min(n, len(shown_at) - 1)]
        elif packet_times:
            t = frame.pts * tb if frame.pts is not None else None
            if t is None or (last is not None and t <= last):
                t = packet_times[min(n, len(packet_times) - 1)]
                if last is not None and t <= last:
                    continue
            last = t
        elif frame.pts is None:
            continue
        else:
            t = frame.pts * tb
        yield t, frame


def _pick_dense(timed, times: list[float], order: list[int], eps: float) -> tuple[list[Image.Image | None], int]:
    """The frame on screen at each of ``times`` (seconds from the first frame) among the decoded
    ``(time, frame)`` pairs ``timed`` (in display order), and the first frame's display rotation.

    Each time takes the frame before the first one shown more than ``eps`` after it (the first
    frame for a time before it, the last for times past the end). A frame becomes an image only
    when a time takes it, once however many take it.
    """
    out: list[Image.Image | None] = [None] * len(times)
    first, rotation = None, 0
    k, prev = 0, None
    shot: list = [None, None]  # the frame last turned into an image, and its image

    def image(frame) -> Image.Image:
        if shot[0] is not frame:
            shot[:] = [frame, frame.to_image()]
        return shot[1]

    for t, frame in timed:
        if first is None:
            first, rotation = t, int(round(frame.rotation or 0)) % 360
        while k < len(order) and first + times[order[k]] + eps < t:
            out[order[k]] = image(prev if prev is not None else frame)
            k += 1
        if k >= len(order):
            break
        prev = frame
    if prev is not None:
        for i in order[k:]:
            out[i] = image(prev)
    return out, rotation


def _frame_on_screen(container, stream, time_s: float, first: float, eps: float,
                     runs: _Runs | None = None, source: Path | bytes | None = None) -> Image.Image | None:
    """The frame of ``stream`` on screen ``time_s`` seconds after its first frame (at ``first`` s),
    found by seeking to the keyframe before it and decoding forward (through ``runs``, where given:
    skipping frames, and going on from the decode of an earlier time where the seek lands on the
    same packet).

    A seek that lands after that time is retried from 1, 2, 4 ... s earlier, and from the start
    at last: an MPEG-TS seek stops at a packet before the time, but the decoder starts at the next
    keyframe, so the frame taken was up to a keyframe interval late (or none at all past the last
    keyframe). Where a seek to the start does not reach the first frame (:func:`_from_start`), the
    file ``source`` is decoded from its start.
    """
    tb = float(stream.time_base)
    target = first + time_s
    back = 0.0
    while True:
        at = max(time_s - back, 0.0)
        offset = int(at / tb) + (stream.start_time or 0)
        if runs is not None:
            chosen = runs.from_seek(offset, time_s).scan(target + eps, at)
        else:
            container.seek(offset, stream=stream, backward=True, any_frame=False)
            frames = container.decode(stream)
            if at == 0 and source is not None:
                frames = _from_start(frames, tb, first, source)
            chosen = _Run(frames, None, tb).scan(target + eps, at)
            frames.close()
        if chosen is not None or at == 0:
            return chosen.to_image() if chosen is not None else None
        back = max(2 * back, 1.0)


def _from_start(frames, tb: float, first: float, source: Path | bytes):
    """The frames of ``frames``, a decode after a seek to the start of the stream, where the first
    it puts out is the stream's first frame (at ``first`` s); else those of a decode of ``source``
    opened afresh, which starts at its first frame.

    MPEG-TS and FLV seek by decode time (TS to any packet, FLV to a keyframe), and in a stream with
    B-frames the first frame is decoded before the time it is shown at: the seek to that time lands
    after the first keyframe (TS: on a packet after it; FLV: on a keyframe within the B-frame delay),
    so the decoder starts at a later keyframe and a time before it took a frame up to a keyframe
    interval late (0 s in a TS file: the keyframe at 4 s).
    """
    for frame in frames:
        if frame.pts is None:
            continue
        if frame.pts * tb <= first:
            yield frame
            yield from frames
            return
        break
    fresh = _open_video(source)
    try:
        yield from fresh.decode(fresh.streams.video[0])
    finally:
        fresh.close()


class _Run:
    """A decode from one seek (the skipping one of :func:`_frames_skipping`, or a plain one), read
    as far as the times served so far: ``last`` is the last frame put out at or before the latest of them, ``ahead``
    the frame after it (read to find that it is after)."""

    __slots__ = ("frames", "landing", "tb", "last", "ahead")

    def __init__(self, frames, landing: tuple | None, tb: float) -> None:
        self.frames, self.landing, self.tb = frames, landing, tb
        self.last = self.ahead = None

    def scan(self, limit: float, at: float):
        """The frame :func:`_frame_on_screen` takes for a time whose frame is the last shown at or
        before ``limit`` (its time plus the tick), from a seek to ``at`` seconds (frames without a
        time are passed over): what a fresh seek and decode takes when its seek lands where this
        run's did, as the frames this run passed were all at or before the earlier (so also this)
        time. A plain decode after one seek is a run of its own, scanned once."""
        chosen = self.last
        while True:
            frame = self.ahead if self.ahead is not None else next(self.frames, None)
            self.ahead = None
            if frame is None:
                return chosen
            if frame.pts is None:
                continue
            if frame.pts * self.tb > limit:
                self.ahead = frame
                return frame if chosen is None and at == 0 else chosen  # at 0, nothing before: the first frame
            chosen = self.last = frame


class _Runs:
    """The decodes of a sparse request that skip frames, each from a seek (in an MP4/MOV file,
    :func:`_skip_depth`), with a second handle on the file (``probe``) to learn where a seek
    lands (its first packet) without seeking the decoding one. A time whose seek lands on the
    packet the current run's seek landed on is served by reading that run on: a fresh seek would
    give the decoder the same packets from a flushed state (MP4 seeks by its index, whatever was
    read before), so the same frames. ``offsets`` are the request's times, sorted; a run is told
    of every time from its own on, so it keeps what a later time it serves may take."""

    def __init__(self, container, stream, probe, offsets: list[float], first: float, eps: float, depth: int) -> None:
        self.container, self.stream, self.probe = container, stream, probe
        self.offsets, self.first, self.eps, self.depth = offsets, first, eps, depth
        self.run: _Run | None = None

    def _landing(self, offset: int) -> tuple | None:
        stream = self.probe.streams.video[0]
        self.probe.seek(offset, stream=stream, backward=True, any_frame=False)
        for pkt in self.probe.demux(stream):
            if pkt.size:
                return pkt.pos, pkt.dts, pkt.pts
        return None

    def from_seek(self, offset: int, time_s: float) -> _Run:
        """The run serving the time ``time_s`` from a seek to ``offset`` (in the stream's ticks):
        the current one where that seek lands on the packet its seek landed on, else a new one."""
        landing = self._landing(offset)
        if self.run is None or landing is None or landing != self.run.landing:
            self.close()
            self.container.seek(offset, stream=self.stream, backward=True, any_frame=False)
            later = [o for o in self.offsets if o >= time_s]
            frames = _frames_skipping(self.container, self.stream, later, self.eps, self.depth, start=self.first)
            self.run = _Run(frames, landing, float(self.stream.time_base))
        return self.run

    def close(self) -> None:
        if self.run is not None:
            self.run.frames.close()  # a skipping decode hands the decoder back as it found it
            self.run = None


#: Decoders that, told to skip non-reference frames (``skip_frame`` NONREF), skip only frames
#: no other frame is predicted from: H.264's with ``nal_ref_idc`` 0, the B-frames of MPEG-4
#: Part 2 and MPEG-1/2, and HEVC's sub-layer non-reference pictures, which only a stream of one
#: temporal layer never refers to (a higher layer may).
_NONREF_CODECS = ("h264", "hevc", "mpeg4", "mpeg1video", "mpeg2video")
#: How many packets the skipping decode reads ahead of the one it sends: enough to know the
#: frame shown next after a B-frame (its neighbour in decode order, or a reference already read).
_LOOKAHEAD = 8


class _PlanBroken(Exception):
    """A decode that skips frames met a stream its plan does not hold for (times missing,
    repeated or out of the decoder's order, a frame missing or damaged): decode every frame."""


def _skip_depth(container, stream, seeking: bool) -> int | None:
    """The decoder's reorder depth where :func:`_frames_skipping` may skip frames of ``stream``,
    else ``None``.

    It may in MP4/MOV and Matroska/WebM files, whose packets are one frame each with its
    presentation time, of a codec in :data:`_NONREF_CODECS` (HEVC: when the ``hvcC`` header
    says one temporal layer). A decode that seeks (``seeking``) skips in MP4/MOV only: a seek
    there lands where the file's index says, while in others (a Matroska file without cues,
    MPEG-TS) it depends on the packets read before, which a skipping decode reads differently.
    """
    cc = stream.codec_context
    if container.format.name not in (("mov",) if seeking else ("mov", "matroska")) or cc.name not in _NONREF_CODECS:
        return None
    depth = getattr(cc, "reorder_depth", None)  # FFmpeg's has_b_frames as a number, where this PyAV has it
    if not isinstance(depth, int):
        return None
    if cc.name == "hevc":
        extra = cc.extradata or b""
        if len(extra) < 23 or extra[0] != 1 or (extra[21] >> 3) & 7 != 1:  # hvcC numTemporalLayers
            return None
    return depth


def _frames_skipping(container, stream, offsets: list[float], eps: float, depth: int, start: float | None = None):
    """The frames a plain decode of ``stream`` from its current position gives
    (``container.decode(stream)``), less non-reference frames that no request can take,
    which the decoder is told to skip (``skip_frame`` NONREF, set per packet before it is sent).

    A request at ``offsets[i]`` seconds (sorted) after ``start`` (the first frame's time when
    ``None``) takes the last frame shown at or before ``start + offsets[i] + eps``, as
    :func:`counted_frames` picks. From the packets read so far (up to :data:`_LOOKAHEAD` ahead of
    the one sent), a packet shown at ``s`` is decoded when the frame shown next after it
    comes after a request that ``s`` does not pass, when it may be the first frame, and
    when it comes after every request (the frame that ends the decode); others are skipped
    if nothing refers to them. Worked example: frames at 0, 1, 2, 3 s, one request at 1.5 s:
    the frame at 1 s is decoded (the next, 2 s, is after 1.5 s), so are 0 (the first) and
    2 and 3 (after the request); had the request been at 2.5 s, the one at 1 s could go.

    The plan holds while the decoder puts out one frame per packet, in presentation order. Each
    packet is checked as it is read (a time, not repeated, and no more packets before it shown
    after it than the decoder's reorder ``depth`` holds, so that no decoder drops a frame as
    out of order), and each frame as it comes out (a packet's time, later than the last, not
    corrupt, and no skipped frame between it and the last that a request could take).

    Raises:
        _PlanBroken: when a check fails; the caller decodes every frame instead.
    """
    tb = float(stream.time_base)
    cc = stream.codec_context
    coded: list[float] = []  # the times of every packet read, sorted
    shown: list[float] = []  # the times of those whose frame is put out (an edit list hides the others)
    from_first = start is None  # the requests count from the first frame, found by reading
    limits = None if from_first else [start + o + eps for o in offsets]
    pending: deque = deque()
    packets = container.demux(stream)
    more, skipping, last = True, False, None
    skipped_first = float("inf")  # the earliest time of a frame the decoder was let skip
    key = None  # the time of the first packet read
    try:
        while True:
            while more and len(pending) <= _LOOKAHEAD:
                pkt = next(packets, None)
                if pkt is None:
                    more = False
                    break
                if not pkt.size:  # the empty packet at the end, which drains the decoder
                    pending.append((pkt, None, False))
                    continue
                if pkt.pts is None:
                    raise _PlanBroken("a packet without a time")
                t, hidden = pkt.pts * tb, pkt.is_discard
                pending.append((pkt, t, hidden))
                i = bisect_right(coded, t)
                if i and coded[i - 1] == t:
                    raise _PlanBroken("two packets at one time")
                if len(coded) - i > depth:
                    raise _PlanBroken("frames reordered deeper than the decoder holds")
                coded.insert(i, t)
                if key is None:
                    key = t
                if not hidden:
                    if from_first and limits is not None and t < shown[0]:
                        raise _PlanBroken("a frame shown before the first")
                    insort(shown, t)
            if not pending:
                break
            pkt, t, hidden = pending.popleft()
            if limits is None and shown:
                limits = [shown[0] + o + eps for o in offsets]
            # a frame shown before the first packet read (a keyframe) may be one a decode from there
            # drops (an open GOP's leading frame): it is sent as a plain decode sends it
            skip = t is not None and (hidden or (limits is not None and t > key and
                                                 not _may_be_taken(t, shown, limits)))
            if skip != skipping:
                cc.skip_frame = "NONREF" if skip else "NONE"
                skipping = skip
            if skip and not hidden:
                skipped_first = min(skipped_first, t)
            for frame in pkt.decode():
                pts = frame.pts
                if pts is None or frame.is_corrupt or limits is None:
                    raise _PlanBroken("a frame without a time, or damaged")
                t = pts * tb
                k = bisect_left(shown, t)
                if k == len(shown) or shown[k] != t:
                    raise _PlanBroken("a frame at no packet's time")
                if last is None:
                    # after a seek, the frames shown before the keyframe it lands on (an open GOP's) may
                    # not be put out at all, as a plain decode does not put them out: if none was skipped
                    # it sees them as a plain decode does, and else they matter only to a request before
                    # that keyframe
                    if k and (from_first or (skipped_first < t and limits[0] < t)):
                        raise _PlanBroken("the first frame put out is not the first shown")
                elif t <= last:
                    raise _PlanBroken("frames out of order")
                elif _taken_between(shown, limits, last, t):
                    raise _PlanBroken("a request takes a frame that was not put out")
                last = t
                yield frame
        if shown and last is None:
            raise _PlanBroken("no frame put out")
        if last is not None and _taken_between(shown, limits, last, float("inf")):
            raise _PlanBroken("a request takes a frame after the last put out")
    finally:
        if skipping:
            cc.skip_frame = "NONE"


def _may_be_taken(s: float, shown: list[float], limits: list[float]) -> bool:
    """Whether the frame shown at ``s`` may be taken, or needed to end the decode, given the
    times ``shown`` of the frames read so far and the requests' ``limits`` (both sorted): the
    first frame, a frame after every request, and one a request falls on before the frame
    shown next (when none is read yet, it may come after any).

    Example:
        >>> _may_be_taken(1.0, [0.0, 1.0, 2.0, 3.0], [1.5]), _may_be_taken(1.0, [0.0, 1.0, 2.0, 3.0], [2.5])
        (True, False)
    """
    if s == shown[0]:
        return True
    j = bisect_left(limits, s)
    if j == len(limits):
        return True
    k = bisect_right(shown, s)
    return k == len(shown) or limits[j] < shown[k]


def _taken_between(shown: list[float], limits: list[float], last: float, t: float) -> bool:
    """Whether a request falls from a frame shown after ``last`` up to before ``t`` (where the
    frames at ``last`` and ``t`` are put out one after the other), so that it takes a frame a
    plain decode puts out and the skipping one did not.

    Example:
        >>> _taken_between([0.0, 1.0, 2.0], [1.5], 0.0, 2.0), _taken_between([0.0, 1.0, 2.0], [0.5], 0.0, 2.0)
        (True, False)
    """
    i = bisect_right(shown, last)
    if i == len(shown) or shown[i] >= t:
        return False
    j = bisect_left(limits, shown[i])
    return j < len(limits) and limits[j] < t


# display rotation (counterclockwise degrees) -> PIL transpose that shows the frame upright
_ROTATE = {90: Image.Transpose.ROTATE_90, 180: Image.Transpose.ROTATE_180, 270: Image.Transpose.ROTATE_270}


def read_media_bytes(ref: MediaRef, media_root: Path) -> bytes:
    """The original bytes of a media item, for embedding in packed shards."""
    if ref.data is not None:
        return ref.data
    if ref.path is None:
        raise SampleError("missing_media", "media item has neither a path nor inline bytes")
    return resolve_media_path(ref.path, media_root).read_bytes()

