"""Header-only image probing: EXIF orientation, truncation, decompression bombs, path escapes."""

from __future__ import annotations

import io
import os

import pytest
from PIL import Image

from packtool.errors import SampleError
from packtool.media import MediaPathResolver, probe_image, read_media_bytes, resolve_media_path
from packtool.records import MediaRef


def _jpeg(w: int, h: int, orientation: int | None = None) -> bytes:
    buf = io.BytesIO()
    img = Image.new("RGB", (w, h), (120, 30, 200))
    exif = Image.Exif()
    if orientation is not None:
        exif[0x0112] = orientation
    img.save(buf, format="JPEG", exif=exif.tobytes())
    return buf.getvalue()


def _png(w: int, h: int) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (w, h), (1, 2, 3)).save(buf, format="PNG")
    return buf.getvalue()


@pytest.mark.parametrize("orientation,swapped", [(1, False), (3, False), (5, True), (6, True), (7, True), (8, True)])
def test_exif_orientation_swaps_sides_when_applied(orientation, swapped):
    data = _jpeg(640, 480, orientation)
    applied = probe_image(data, exif="apply")
    ignored = probe_image(data, exif="ignore")
    assert (ignored.width, ignored.height) == (640, 480)
    assert (applied.width, applied.height) == ((480, 640) if swapped else (640, 480))
    assert applied.orientation == orientation


def test_exif_apply_matches_pillow_transpose(tmp_path):
    from PIL import ImageOps

    path = tmp_path / "rot.jpg"
    path.write_bytes(_jpeg(300, 100, 6))
    with Image.open(path) as im:
        upright = ImageOps.exif_transpose(im).size
    info = probe_image(path, exif="apply")
    assert (info.width, info.height) == upright == (100, 300)


_XMP_ORIENTATION_6 = (b'<x:xmpmeta xmlns:x="adobe:ns:meta/"><rdf:RDF xmlns:rdf="http://www.w3.org/1999/02/22-rdf-syntax-ns#">'
                      b'<rdf:Description xmlns:tiff="http://ns.adobe.com/tiff/1.0/" tiff:Orientation="6"/>'
                      b'</rdf:RDF></x:xmpmeta>')


def _turned(fmt: str) -> bytes:
    """A 300x100 image stored with orientation 6: TIFF in its own tag, JPEG in XMP only (no EXIF)."""
    buf = io.BytesIO()
    img = Image.new("RGB", (300, 100), (5, 50, 150))
    if fmt == "TIFF":
        exif = Image.Exif()
        exif[0x0112] = 6
        img.save(buf, format="TIFF", exif=exif)
    else:
        img.save(buf, format="JPEG", xmp=_XMP_ORIENTATION_6)
    return buf.getvalue()


@pytest.mark.parametrize("fmt", ["TIFF", "JPEG-XMP"])
@pytest.mark.parametrize("exif", ["apply", "ignore"])
def test_orientation_outside_exif_probes_as_the_loader_sees_it(fmt, exif):
    from PIL import ImageOps

    data = _turned(fmt.split("-")[0])
    with Image.open(io.BytesIO(data)) as im:
        seen = (ImageOps.exif_transpose(im) if exif == "apply" else im.convert("RGB")).size
    info = probe_image(data, exif=exif)
    assert (info.width, info.height) == seen


def _png_chunks(data: bytes) -> list[bytes]:
    """A PNG's chunks, each whole (length, type, data, CRC)."""
    out, i = [], 8
    while i < len(data):
        n = int.from_bytes(data[i:i + 4], "big")
        out.append(data[i:i + 12 + n])
        i += 12 + n
    return out


def _png_chunk(kind: bytes, body: bytes) -> bytes:
    import zlib

    return len(body).to_bytes(4, "big") + kind + body + zlib.crc32(kind + body).to_bytes(4, "big")


def _png_turned(where: str) -> bytes:
    """A 300x100 PNG stored with orientation 6, in an ``eXIf`` chunk or XMP (``iTXt``) placed
    ``before`` or ``after`` its image data (both are valid PNG; ``none``: no orientation at all)."""
    buf = io.BytesIO()
    Image.new("RGB", (300, 100), (5, 50, 150)).save(buf, format="PNG")
    chunks = _png_chunks(buf.getvalue())
    exif = Image.Exif()
    exif[0x0112] = 6
    meta = {"none": b"", "exif": _png_chunk(b"eXIf", exif.tobytes()),
            "xmp": _png_chunk(b"iTXt", b"XML:com.adobe.xmp\x00\x00\x00\x00\x00" + _XMP_ORIENTATION_6)}[where.split("-")[0]]
    at = 1 if where.endswith("before") else len(chunks) - 1  # after IHDR, or just before IEND
    return b"\x89PNG\r\n\x1a\n" + b"".join(chunks[:at]) + meta + b"".join(chunks[at:])


@pytest.mark.parametrize("where", ["none", "exif-before", "exif-after", "xmp-before", "xmp-after"])
@pytest.mark.parametrize("local", [False, True])
def test_png_orientation_is_read_without_decoding_the_pixels(monkeypatch, tmp_path, where, local):
    """``--exif apply`` (Molmo2's default) decoded every PNG that carries no EXIF before its pixels:
    Pillow looks for an ``eXIf`` chunk after the image data by decoding it. The chunks are walked
    instead; only a PNG with metadata after its pixels is still decoded, and both give the size
    ``exif_transpose`` gives, from bytes and from a local file alike (whose one open file the
    chunk walk shares with Pillow)."""
    from PIL import ImageOps, PngImagePlugin

    data = _png_turned(where)
    with Image.open(io.BytesIO(data)) as im:
        seen = ImageOps.exif_transpose(im).size
    loads = []
    load = PngImagePlugin.PngImageFile.load
    monkeypatch.setattr(PngImagePlugin.PngImageFile, "load", lambda im: loads.append(1) or load(im))
    if local:
        (tmp_path / "x.png").write_bytes(data)
    info = probe_image(tmp_path / "x.png" if local else data, exif="apply")
    assert (info.width, info.height) == seen == ((300, 100) if where == "none" else (100, 300))
    assert len(loads) == (1 if where.endswith("after") else 0), where


def _odd(kind: str) -> bytes:
    """A small image of an unusual mode or layout, as cameras, scanners and editors write them."""
    import numpy as np

    rng = np.random.default_rng(7)
    rgb = Image.fromarray(rng.integers(0, 256, (30, 50, 3), dtype=np.uint8))
    buf = io.BytesIO()
    if kind in ("gif", "webp", "apng"):  # animated: every loader takes the first frame
        frames = [rgb.resize((50, 30)), rgb.rotate(90, expand=True).resize((50, 30))]
        frames[0].save(buf, format={"apng": "PNG"}.get(kind, kind.upper()), save_all=True,
                       append_images=frames[1:], duration=50)
    elif kind == "I;16.png":
        Image.fromarray(rng.integers(0, 65535, (30, 50)).astype(np.uint16)).save(buf, format="PNG")
    elif kind == "F.tiff":
        Image.fromarray(rng.random((30, 50)).astype(np.float32), "F").save(buf, format="TIFF")
    elif kind == "P-transparent.png":
        rgb.convert("P").save(buf, format="PNG", transparency=0)
    else:
        mode, fmt = kind.split(".")
        rgb.convert(mode).save(buf, format={"jpg": "JPEG"}.get(fmt, fmt.upper()),
                               **({"progressive": True} if mode == "RGB" else {}))
    return buf.getvalue()


@pytest.mark.parametrize("kind", ["CMYK.jpg", "RGB.jpg", "I;16.png", "P-transparent.png", "LA.png", "1.png", "F.tiff",
                                  "CMYK.tiff", "RGBA.webp", "gif", "webp", "apng"])
@pytest.mark.parametrize("exif", ["apply", "ignore"])
def test_odd_modes_probe_as_the_loader_and_the_reader_decode_them(kind, exif):
    """Every mode a corpus holds (CMYK, 16-bit, palette with transparency, float, animated)
    probes as the size a loader sees (``convert("RGB")``, after ``exif_transpose`` when applied)
    and as the reader decodes it: an RGB image of the counted size."""
    from PIL import ImageOps

    from packtool.reader import decode_image

    data = _odd(kind)
    with Image.open(io.BytesIO(data)) as im:
        seen = (ImageOps.exif_transpose(im) if exif == "apply" else im).convert("RGB").size
    info = probe_image(data, exif=exif)
    got = decode_image({"kind": "image", "data": data}, exif=exif == "apply")
    assert (info.width, info.height) == seen == got.size == (50, 30) and got.mode == "RGB"


def test_png_and_file_paths(tmp_path):
    path = tmp_path / "a.png"
    path.write_bytes(_png(33, 17))
    info = probe_image(path)
    assert (info.width, info.height, info.format) == (33, 17, "PNG")


@pytest.mark.parametrize("maker,cut", [(_jpeg, 200), (_png, 40)])
def test_truncated_files_are_caught_by_the_tail_check(tmp_path, maker, cut):
    data = maker(400, 300)
    bad = data[: len(data) - cut]
    with pytest.raises(SampleError) as err:
        probe_image(bad)
    assert err.value.reason == "corrupt_image" and "truncated" in err.value.message
    path = tmp_path / "cut.bin"
    path.write_bytes(bad)
    with pytest.raises(SampleError):
        probe_image(path)
    assert probe_image(data).width == 400  # the intact file passes


def _noise(fmt: str, mode: str, **options) -> bytes:
    import numpy as np

    rgb = Image.fromarray(np.random.default_rng(3).integers(0, 256, (37, 53, 3), dtype=np.uint8))
    buf = io.BytesIO()
    rgb.convert(mode).save(buf, format=fmt, **options)
    return buf.getvalue()


@pytest.mark.parametrize("fmt,mode,options", [
    ("BMP", "RGB", {}), ("BMP", "RGBA", {}), ("BMP", "P", {}), ("BMP", "1", {}),
    ("TIFF", "RGB", {}), ("TIFF", "I;16", {}), ("TIFF", "L", {}),
])
def test_bmp_and_tiff_cut_inside_their_pixel_data_are_truncated(tmp_path, fmt, mode, options):
    """BMP and TIFF have no end marker, so the tail check passed them cut anywhere after the
    header: tokenize and pack took the row and the trainer's decode stopped on it. The pixel data
    the header places must fit the file; a BMP cut inside its last row's padding still decodes
    and still passes."""
    data = _noise(fmt, mode, **options)
    for cut in (len(data) // 2, len(data) - 3 if fmt == "TIFF" else len(data) - 9):
        bad = data[:cut]
        with pytest.raises(OSError):
            Image.open(io.BytesIO(bad)).load()  # truly undecodable
        with pytest.raises(SampleError) as err:
            probe_image(bad)
        assert err.value.reason == "corrupt_image" and f"truncated {fmt}" in err.value.message
        path = tmp_path / f"cut.{fmt.lower()}"
        path.write_bytes(bad)
        with pytest.raises(SampleError, match=f"truncated {fmt}"):
            probe_image(path)
    assert (probe_image(data).width, probe_image(data).height) == (53, 37)
    if fmt == "BMP" and mode == "RGB":  # rows of 159 bytes in a stride of 160: the last pad byte is not needed
        Image.open(io.BytesIO(data[:-1])).load()
        assert probe_image(data[:-1]).width == 53


def test_jpeg_with_trailing_bytes_after_eoi_passes():
    assert probe_image(_jpeg(64, 64) + b"\x00" * 100).width == 64


def _noise_jpeg(seed: int, **save) -> bytes:
    import numpy as np

    pixels = np.random.default_rng(seed).integers(0, 256, (120, 160, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="JPEG", **save)
    return buf.getvalue()


def _noise_mp4(seed: int) -> bytes:
    import av
    import numpy as np

    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    with av.open(buf, "w", format="mp4") as out:
        st = out.add_stream("libx264", rate=10)
        st.width, st.height, st.pix_fmt = 64, 48, "yuv420p"
        for _ in range(10):
            frame = av.VideoFrame.from_ndarray(rng.integers(0, 256, (48, 64, 3), dtype=np.uint8), format="rgb24")
            for pkt in st.encode(frame):
                out.mux(pkt)
        for pkt in st.encode():
            out.mux(pkt)
    return buf.getvalue()


@pytest.mark.parametrize("progressive", [False, True])
def test_a_motion_photo_with_its_video_after_the_picture_passes(tmp_path, progressive):
    """Phone motion photos (Google ``.MP.jpg``, Samsung) append an MP4 after the JPEG's end-of-image
    marker; decoders show the picture and ignore the rest, so probing must not call it truncated."""
    jpeg = _noise_jpeg(11, progressive=progressive, comment=b"thumb \xff\xd9 end")
    data = jpeg + _noise_mp4(12)
    assert b"\xff\xd9" not in data[-4096:]  # the marker is far from the tail
    with Image.open(io.BytesIO(data)) as im:
        im.load()
        assert im.size == (160, 120)
    path = tmp_path / "PXL_0001.MP.jpg"
    path.write_bytes(data)
    assert (probe_image(data).width, probe_image(path).height) == (160, 120)
    # the walk from the start is no looser than the tail check: a JPEG cut in its scan data is
    # truncated, even with an FFD9 earlier in the file (inside its comment segment)
    with pytest.raises(SampleError) as err:
        probe_image(jpeg[: len(jpeg) - 4200])
    assert err.value.reason == "corrupt_image" and "truncated" in err.value.message


def _jpeg_end_by_regex(data: bytes) -> int | None:
    """The segment walk as it was written first, with one regular expression for a marker: the
    twin the linear scan must agree with."""
    import re

    marker = re.compile(rb"\xff+([^\x00\x01\xd0-\xd7\xff])")
    if not data.startswith(b"\xff\xd8"):
        return None
    i = 2
    while (m := marker.search(data, i)) is not None:
        i = m.end()
        if m.group(1) == b"\xd9":
            return i
        if i + 2 > len(data):
            return None
        i += int.from_bytes(data[i : i + 2], "big")
    return None


@pytest.mark.parametrize("seed", range(3))
def test_the_jpeg_segment_walk_is_the_regex_walk_and_crosses_a_fill_once(seed):
    """The walk finds the same end as the regular-expression form on random bytes drawn from the
    ones that matter (``FF`` runs, stuffed ``00``, restarts, ``D9``, lengths); and a JPEG whose end
    is a long run of ``FF`` fill (a file recovered from erased flash, or preallocated) is truncated,
    answered in one pass over the run: the regular expression retried every start in it (13 s for
    40 KB here, about two hours for 1 MB)."""
    import random

    from packtool.media import _jpeg_end

    rng = random.Random(seed)
    alphabet = [0xFF] * 6 + [0x00, 0x01, 0xD0, 0xD7, 0xD8, 0xD9, 0xDA, 0xE0, 0xFE, 0x02, 0x05, 0x12]
    for _ in range(3000):
        body = bytes(rng.choice(alphabet) if rng.random() < 0.8 else rng.randrange(256)
                     for _ in range(rng.randrange(1, 60)))
        data = b"\xff\xd8" + body
        assert _jpeg_end(data) == _jpeg_end_by_regex(data), f"seed {seed}: {data.hex()}"
    whole = _noise_jpeg(30 + seed)
    assert _jpeg_end(whole) == _jpeg_end_by_regex(whole) == len(whole)
    filled = whole[:-2] + b"\xff" * 1_000_000  # the end-of-image marker lost, the rest fill
    assert _jpeg_end(filled) is None
    with pytest.raises(SampleError) as err:
        probe_image(filled)
    assert err.value.reason == "corrupt_image" and "truncated JPEG" in err.value.message


def test_a_jpeg_cut_just_after_an_embedded_thumbnail_is_truncated():
    """An EXIF thumbnail is a whole JPEG, end-of-image marker included, inside the APP1 segment:
    a file cut within 4 KiB after it holds an ``FFD9`` in its tail, yet every decoder calls it
    truncated. Only a marker at the very end, or one the segment walk reaches, ends the picture."""
    thumb = _noise_jpeg(21)
    app1 = b"\xff\xe1" + (len(thumb) + 8).to_bytes(2, "big") + b"Exif\x00\x00" + thumb
    photo = _noise_jpeg(22, quality=95)
    data = photo[:2] + app1 + photo[2:]
    cut = data[: 2 + len(app1) + 2000]
    assert b"\xff\xd9" in cut[-4096:]
    with Image.open(io.BytesIO(cut)) as im, pytest.raises(OSError):
        im.load()
    with pytest.raises(SampleError) as err:
        probe_image(cut)
    assert err.value.reason == "corrupt_image" and "truncated JPEG" in err.value.message
    assert probe_image(data).width == 160  # the whole file passes


def test_garbage_is_corrupt():
    with pytest.raises(SampleError) as err:
        probe_image(b"not an image at all")
    assert err.value.reason == "corrupt_image"


def test_decompression_bomb_limit_stays_on(monkeypatch):
    # a real PNG whose header declares more pixels than the (lowered) limit
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 1000)
    with pytest.raises(SampleError) as err:
        probe_image(_png(40, 40))  # 1600 > 1000
    assert err.value.reason == "image_too_large"
    assert err.value.message == ("image of 1,600 px exceeds Pillow's decompression-bomb limit (1,000 px), past which "
                                 "packtool refuses an image (Pillow warns, and refuses from twice the limit)")
    with pytest.raises(SampleError) as err:
        probe_image(_png(50, 50))  # past twice the limit: Pillow's error, which names 2,000
    assert err.value.message.startswith("image of 2,500 px exceeds Pillow's decompression-bomb limit (1,000 px)")


def test_dotdot_absolute_and_symlink_escapes_are_refused(tmp_path):
    root = tmp_path / "root"
    (root / "sub").mkdir(parents=True)
    outside = tmp_path / "secret.png"
    outside.write_bytes(_png(4, 4))
    (root / "ok.png").write_bytes(_png(4, 4))
    os.symlink(outside, root / "sub" / "link.png")
    os.symlink(root / "ok.png", root / "sub" / "inside.png")
    for bad in ("../secret.png", "sub/../../secret.png", str(outside), "sub/link.png"):
        with pytest.raises(SampleError) as err:
            resolve_media_path(bad, root)
        assert err.value.reason == "path_outside_root", bad
        with pytest.raises(SampleError):
            read_media_bytes(MediaRef("image", bad), root)
    assert resolve_media_path("sub/inside.png", root) == (root / "ok.png").resolve()  # a link that stays inside
    assert resolve_media_path(str(root / "ok.png"), root) == (root / "ok.png").resolve()
    with pytest.raises(SampleError) as err:
        resolve_media_path("missing.png", root)
    assert err.value.reason == "missing_media"
    # the memoizing resolver the pack stage uses: the same path or the same refusal, twice over
    (root / "sub" / "plain.png").write_bytes(_png(4, 4))
    (root / "d").mkdir()
    os.symlink(tmp_path, root / "sub" / "up")  # a directory link that leaves the root
    os.mkfifo(root / "pipe.png")  # opened for reading, a FIFO waits for a writer: the fast paths must not
    resolver = MediaPathResolver(root)
    for path in ("../secret.png", "sub/../../secret.png", str(outside), "sub/link.png", "sub/inside.png", "ok.png",
                 str(root / "ok.png"), "missing.png", "sub/plain.png", "./sub/plain.png", "sub//plain.png",
                 "sub/../ok.png", "d", "pipe.png", "", ".", "sub/up/secret.png", "sub/up/root/ok.png", "/ok.png", "/", "sub/") * 2:
        try:
            want = resolve_media_path(path, root)
        except SampleError as e:
            with pytest.raises(SampleError) as err:
                resolver(path)
            assert err.value.reason == e.reason, path
            for fast in (resolver.read, resolver.stat):  # the reading and stat fast paths refuse the same way
                with pytest.raises(SampleError) as err:
                    fast(path)
                assert err.value.reason == e.reason, path
        else:
            assert resolver(path) == want, path
            assert resolver.read(path) == want.read_bytes(), path
            assert resolver.stat(path) == want.stat(), path


def test_escape_becomes_an_errors_jsonl_line(tmp_path):
    import json

    from packtool import TokenizeConfig, tokenize_dataset

    root = tmp_path / "media"
    root.mkdir()
    (tmp_path / "secret.png").write_bytes(_png(8, 8))
    (root / "fine.png").write_bytes(_png(8, 8))
    rows = [{"id": "a", "image": "../secret.png", "conversations": [{"from": "human", "value": "<image>hi"},
                                                                     {"from": "gpt", "value": "yo"}]},
            {"id": "b", "image": "fine.png", "conversations": [{"from": "human", "value": "<image>hi"},
                                                               {"from": "gpt", "value": "yo"}]}]
    data = tmp_path / "d.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    manifest = tokenize_dataset([data], tmp_path / "tok", TokenizeConfig(media_root=str(root)))
    assert manifest["counts"]["samples"] == 1
    assert manifest["counts"]["rejected_by_reason"] == {"path_outside_root": 1}




@pytest.mark.parametrize("fmt", ["JPEG", "PNG", "GIF", "WEBP"])
@pytest.mark.parametrize("cut", [False, True])
@pytest.mark.parametrize("exif", ["ignore", "apply"])
def test_a_local_image_is_opened_once_for_its_header_and_tail_check(tmp_path, monkeypatch, fmt, cut, exif):
    """The header probe and the truncation check share one open file (with ``exif="apply"`` a
    PNG's walk of its chunk headers too); what they answer is what the same bytes answer in
    memory (a size, or the same truncation error)."""
    import builtins

    buf = io.BytesIO()
    Image.new("RGB", (37, 23), (200, 10, 90)).save(buf, format=fmt)
    data = buf.getvalue()[: -40 if cut else None]
    path = tmp_path / f"x.{fmt.lower()}"
    path.write_bytes(data)

    def probe(source):
        try:
            info = probe_image(source, exif=exif)
            return info.width, info.height, info.format
        except SampleError as err:
            return err.reason, err.message.replace(f"{len(data):,} bytes", "N bytes")

    opened = []
    real_open = builtins.open

    def counting_open(file, *args, **kwargs):
        if os.fspath(file) == os.fspath(path):
            opened.append(file)
        return real_open(file, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", counting_open)
    got = probe(path)
    assert len(opened) == 1, opened
    assert got == probe(data)
    if not cut:
        assert got == (37, 23, fmt)


def test_damaged_exif_is_probed_without_pillow_warnings_on_stderr(recwarn):
    """An EXIF block whose directory points past its end: Pillow warns ("Corrupt EXIF data", "Tag
    data larger than file"), which went to stderr in the middle of a tokenize run. The probe reads
    the image as its loaders do (orientation unknown: 1) and says nothing."""
    buf = io.BytesIO()
    Image.new("RGB", (40, 30)).save(buf, "JPEG")
    jpeg = buf.getvalue()
    exif = b"Exif\x00\x00II*\x00\x08\x00\x00\x00\x05\x00\x01\x01\x04\x00\xff\xff\x00\x00\x10\x00\x00\x00"
    data = jpeg[:2] + b"\xff\xe1" + (len(exif) + 2).to_bytes(2, "big") + exif + jpeg[2:]
    info = probe_image(data, exif="apply")
    assert (info.width, info.height, info.orientation) == (40, 30, 1)
    assert [str(w.message) for w in recwarn] == []
