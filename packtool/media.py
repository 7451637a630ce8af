"""Media probing without decoding pixels, and path resolution under ``--media-root``.

Tokenize only needs dimensions: Pillow reads them from the header; nothing is decoded.
"""

from __future__ import annotations

import io
import os
import warnings
from dataclasses import dataclass
from pathlib import Path

from PIL import Image

from .errors import SampleError
from .records import MediaRef

__all__ = ["ImageInfo", "resolve_media_path", "probe_image", "read_media_bytes"]


@dataclass(frozen=True, slots=True)
class ImageInfo:
    width: int
    height: int
    format: str


def resolve_media_path(path: str, media_root: Path) -> Path:
    """Resolve ``path`` under ``media_root``; refuse anything that escapes it.

    ``..`` components, absolute paths elsewhere and symlinks that point outside the
    root all raise ``path_outside_root``; a path that does not exist raises ``missing_media``.
    """
    root = media_root.resolve()
    candidate = Path(path)
    if not candidate.is_absolute():
        candidate = root / candidate
    resolved = Path(os.path.realpath(candidate))
    if resolved != root and root not in resolved.parents:
        raise SampleError("path_outside_root", f"media path {path!r} resolves outside --media-root {str(root)!r}")
    if not resolved.is_file():
        raise SampleError("missing_media", f"media file {path!r} not found under --media-root {str(root)!r}")
    return resolved


def probe_image(source: Path | bytes) -> ImageInfo:
    """Read an image's size from its header (no pixel decode).

    Raises:
        SampleError: ``corrupt_image`` when the header is unreadable, ``image_too_large``
            when the declared size passes Pillow's decompression-bomb limit.
    """
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            fp = io.BytesIO(source) if isinstance(source, bytes) else source
            with Image.open(fp) as im:
                width, height = im.size
                fmt = im.format or ""
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
        raise SampleError("image_too_large", f"image exceeds Pillow's decompression-bomb limit: {exc}") from None
    except (OSError, SyntaxError, ValueError) as exc:
        raise SampleError("corrupt_image", f"cannot read image header: {exc}") from None
    if width <= 0 or height <= 0:
        raise SampleError("corrupt_image", f"image declares a zero size ({width}x{height})")
    return ImageInfo(width, height, fmt)


def read_media_bytes(ref: MediaRef, media_root: Path) -> bytes:
    """The original bytes of a media item, for embedding in packed shards."""
    if ref.data is not None:
        return ref.data
    if ref.path is None:
        raise SampleError("missing_media", "media item has neither a path nor inline bytes")
    return resolve_media_path(ref.path, media_root).read_bytes()
