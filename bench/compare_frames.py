"""CPU time of ``extract_frames`` (the frames ``pack --media embed`` embeds for a video) in this
tree against the ``packtool/media.py`` of a git revision, alternating in one process.

``python -m bench.compare_frames REV [--rounds R] [--seconds S]`` encodes two clips of S seconds
(default 20) at 640x360, 30 fps with libx264: one at its default B-frames, one with none
(``bf=0``), of noise-like content (a block texture that pans, with blocks that change every
frame). It then asks each for the frames at 2 fps (40 times: one linear decode) and at 0.5 fps
(10 times 2 s apart: a seek per time), R rounds (default 5) of REV's ``extract_frames``, this
tree's, and this tree's with a plain decode (``_skip_depth`` off: the decoder skips no frame and
every seek decodes from its keyframe, so only converting just the frames taken is left), in
turn. The figure is ``time.process_time()`` (the machine is shared; CPU time moves less than wall
time), the median of the rounds; the load average is printed with each round. Every JPEG each
variant returns must be the same bytes.

``python -m bench.compare_frames REV --damaged N`` instead asks REV's ``extract_frames`` and this
tree's for the frames of N damaged copies (bytes flipped, the file cut short, a run of bytes
zeroed, in turn) of four small clips with B-frames (H.264 in MP4 and Matroska, HEVC, MPEG-4 Part 2),
three lists of times each, and counts the requests whose answers (the JPEG bytes, or the error)
differ.
"""

from __future__ import annotations

import collections
import statistics
import subprocess
import sys
import tempfile
import time
import types
from pathlib import Path

import av
import numpy as np

from bench.bench_pack import _load


def _clip(path: Path, seconds: float, fps: int = 30, size: tuple[int, int] = (640, 360), codec: str = "libx264",
          fmt: str | None = None, options: dict[str, str] | None = None, seed: int = 1) -> Path:
    """A clip of a block texture that pans, with blocks that change every frame (libx264 at its
    defaults unless ``options`` say otherwise)."""
    rng = np.random.default_rng(seed)
    w, h = size
    texture = rng.integers(0, 256, size=(h // 8 + 40, w // 8 + 40, 3), dtype=np.uint8).repeat(8, 0).repeat(8, 1)
    side = max(8, min(w, h) // 8)
    with av.open(str(path), "w", format=fmt) as out:
        st = out.add_stream(codec, rate=fps)
        st.width, st.height, st.pix_fmt = w, h, "yuv420p"
        st.options = dict(options or {})
        for i in range(int(seconds * fps)):
            dx, dy = (3 * i) % 256, (i // 2) % 256
            img = texture[dy:dy + h, dx:dx + w].copy()
            for b in range(6):
                x, y = (37 * b + 5 * i) % (w - side), (53 * b + 3 * i * (b + 1)) % (h - side)
                img[y:y + side, x:x + side] = rng.integers(0, 256, 3)
            for p in st.encode(av.VideoFrame.from_ndarray(img, format="rgb24")):
                out.mux(p)
        for p in st.encode():
            out.mux(p)
    return path


def _module_at(rev: str) -> types.ModuleType:
    """``packtool/media.py`` as it was at git revision ``rev``, loaded beside this tree's
    (its relative imports resolve to this tree's ``packtool``)."""
    here = Path(__file__).resolve().parents[1]
    source = subprocess.run(["git", "show", f"{rev}:packtool/media.py"], cwd=here, check=True, capture_output=True,
                            text=True).stdout
    mod = types.ModuleType("packtool._media_before")
    mod.__package__ = "packtool"
    mod.__file__ = f"{rev}:packtool/media.py"
    sys.modules[mod.__name__] = mod
    exec(compile(source, mod.__file__, "exec"), mod.__dict__)  # noqa: S102 - the project's own source
    return mod


def timing(before: types.ModuleType, rev: str, rounds: int, seconds: int) -> bool:
    """Print the CPU-time table; whether every variant returned the same JPEG bytes."""
    import packtool.media as media

    depth = media._skip_depth

    def plain_decode(root, item):
        media._skip_depth = lambda *a, **k: None
        try:
            return media.extract_frames(root, item)
        finally:
            media._skip_depth = depth

    variants = {"before": before.extract_frames, "after": media.extract_frames, "after, plain decode": plain_decode}
    identical = True
    with tempfile.TemporaryDirectory(prefix="compare-frames-") as tmp:
        root = Path(tmp)
        clips = {"default B-frames": _clip(root / "bf.mp4", seconds).name,
                 "bf=0": _clip(root / "nobf.mp4", seconds, options={"bf": "0"}).name}
        rates = {"2 fps": 2.0, "0.5 fps": 0.5}
        print(f"extract_frames, {seconds} s 640x360 30 fps libx264 clips; before = {rev}; "
              f"CPU ms per call, median of {rounds} rounds")
        cpu: dict[tuple[str, str, str], list[float]] = {}
        for r in range(rounds):
            for clip, name in clips.items():
                for rate, fps in rates.items():
                    item = {"path": name, "timestamps": [i / fps for i in range(int(seconds * fps))]}
                    got = {}
                    for variant, fn in variants.items():
                        c0 = time.process_time()
                        got[variant] = fn(root, item)
                        cpu.setdefault((clip, rate, variant), []).append(1e3 * (time.process_time() - c0))
                    identical &= all(v == got["before"] for v in got.values())
            print(f"round {r + 1}: load {_load()}", flush=True)
        print()
        print("| clip | times | before | after | after, plain decode | before / after |")
        print("| --- | --- | ---: | ---: | ---: | ---: |")
        for clip in clips:
            for rate in rates:
                med = {v: statistics.median(cpu[(clip, rate, v)]) for v in variants}
                print(f"| {clip} | {rate} | {med['before']:.0f} | {med['after']:.0f} | "
                      f"{med['after, plain decode']:.0f} | {med['before'] / med['after']:.2f}x |")
    print(f"\nJPEG bytes of every call: {'identical' if identical else 'DIFFERENT'}")
    return identical


def damaged(before: types.ModuleType, copies: int, seed: int = 7) -> None:
    """Print how many requests to damaged copies of small clips get other answers than before."""
    import packtool.media as media
    from packtool.errors import SampleError

    def answer(mod, data: bytes, times: list[float]):
        try:
            return mod.extract_frames(Path("."), {"data": data, "timestamps": times})
        except SampleError as err:
            return err.reason, err.message

    rng = np.random.default_rng(seed)
    kinds = ("bytes flipped", "cut short", "bytes zeroed")
    outcome: collections.Counter = collections.Counter()
    av.logging.set_level(av.logging.PANIC)  # the decoder's complaints about the damage
    with tempfile.TemporaryDirectory(prefix="compare-frames-") as tmp:
        x264 = {"preset": "superfast", "bf": "3", "g": "40"}
        clips = [_clip(Path(tmp) / "a.mp4", 10, 10, (96, 64), options={**x264, "movflags": "faststart"}),
                 _clip(Path(tmp) / "b.mkv", 10, 10, (96, 64), options=x264),
                 _clip(Path(tmp) / "c.mp4", 10, 10, (96, 64), "libx265",
                       options={"preset": "ultrafast", "x265-params": "bframes=3:keyint=40:log-level=error"}),
                 _clip(Path(tmp) / "d.mp4", 10, 10, (96, 64), "mpeg4", options={"bf": "2", "g": "40"})]
        for path in clips:
            whole = path.read_bytes()
            for n in range(copies):
                data = bytearray(whole)
                kind = kinds[n % 3]
                if kind == "bytes flipped":
                    for _ in range(int(rng.integers(1, 20))):
                        data[int(rng.integers(len(data) // 10, len(data)))] ^= int(rng.integers(1, 256))
                elif kind == "cut short":
                    data = data[:int(rng.integers(len(data) // 3, len(data)))]
                else:
                    at = int(rng.integers(len(data) // 10, len(data) - 200))
                    data[at:at + 200] = bytes(200)
                for times in ([0.0, 1.5, 3.0, 4.5, 6.0, 7.5, 9.0], [0.5, 3.1, 5.2, 8.7, 12.0],
                              sorted(rng.uniform(0, 11, 12).tolist())):
                    was, now = answer(before, bytes(data), times), answer(media, bytes(data), times)
                    if was == now:
                        outcome[(kind, "same error" if isinstance(was, tuple) else "same frames")] += 1
                    else:
                        what = "an error, now frames" if isinstance(was, tuple) else "other frames"
                        outcome[(kind, what)] += 1
    print(f"{copies} damaged copies of each of {len(clips)} clips, 3 requests each:")
    for (kind, what), n in sorted(outcome.items()):
        print(f"  {kind}: {what}: {n}")


def main(argv: list[str]) -> int:
    args = list(argv)
    opts = {}
    for key in ("--rounds", "--seconds", "--damaged"):
        if key in args:
            i = args.index(key)
            opts[key] = int(args[i + 1])
            del args[i:i + 2]
    if not args:
        print(__doc__)
        return 2
    before = _module_at(args[0])
    if "--damaged" in opts:
        damaged(before, opts["--damaged"])
        return 0
    return 0 if timing(before, args[0], opts.get("--rounds", 5), opts.get("--seconds", 20)) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
