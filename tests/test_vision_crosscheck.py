"""Optional cross-check of the vision arithmetic against the processors in ``transformers``.

Skipped when ``transformers`` is not installed (it is not a packtool dependency). The
processor modules import torchvision at the top, so the pure functions are lifted
from their source with ``ast`` and run as written; nothing is downloaded.
"""

from __future__ import annotations

import ast
import functools
import importlib.util
import itertools
import math
import random
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from packtool.vision import VideoMeta, get_family
from packtool.vision.internvl import find_closest_aspect_ratio, target_ratios
from packtool.vision.llava_ov import PINPOINTS
from packtool.vision.molmo2 import select_tiling
from packtool.vision.qwen import smart_resize
from packtool.vision.qwen3 import frame_pair_times, smart_resize_video

_spec = importlib.util.find_spec("transformers")
pytestmark = pytest.mark.skipif(_spec is None or not _spec.submodule_search_locations,
                                reason="transformers not installed")
N = 1000


def _lift(rel: str, *names: str, cls: str | None = None) -> dict:
    root = Path(list(_spec.submodule_search_locations)[0])
    tree = ast.parse((root / rel).read_text())
    body = tree.body
    if cls is not None:
        body = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls).body
    ns: dict = {"math": math, "np": np, "itertools": itertools}
    for node in body:
        if isinstance(node, ast.FunctionDef) and node.name in names:
            node.decorator_list = []
            node.returns = None
            for a in node.args.args + node.args.kwonlyargs:
                a.annotation = None
            exec(compile(ast.Module([node], []), rel, "exec"), ns)
    return ns


def _sizes(rng: random.Random, lo: int, hi: int):
    for _ in range(N):
        h = int(math.exp(rng.uniform(math.log(lo), math.log(hi))))
        w = int(math.exp(rng.uniform(math.log(lo), math.log(hi))))
        if max(h, w) / min(h, w) <= 200:
            yield h, w


def test_qwen2_smart_resize_matches():
    ref = _lift("models/qwen2_vl/image_processing_qwen2_vl.py", "smart_resize")["smart_resize"]
    for h, w in _sizes(random.Random(1), 17, 9000):  # sides > 16: both rounding variants agree there
        for factor, lo, hi in ((28, 3136, 12845056), (32, 65536, 16777216)):
            assert smart_resize(h, w, factor, lo, hi) == ref(h, w, factor, lo, hi), (h, w, factor)


def test_qwen3_video_resize_and_timestamps_match():
    ns = _lift("models/qwen3_vl/video_processing_qwen3_vl.py", "smart_resize")
    ts = _lift("models/qwen3_vl/processing_qwen3_vl.py", "_calculate_timestamps", cls="Qwen3VLProcessor")
    rng = random.Random(2)
    for h, w in _sizes(rng, 32, 4000):
        n = rng.randint(2, 800)
        assert smart_resize_video(n, h, w) == ns["smart_resize"](n, h, w, 2, 32, 4096, 25165824), (n, h, w)
        idx = sorted(rng.sample(range(2000), min(n, 50)))
        assert frame_pair_times(idx, 29.97) == ts["_calculate_timestamps"](None, list(idx), 29.97, 2)


def test_llava_ov_counts_match():
    best = _lift("image_processing_utils.py", "select_best_resolution")["select_best_resolution"]
    proc = _lift("models/llava_onevision/processing_llava_onevision.py", "_get_number_of_features",
                 "_get_unpadded_features", cls="LlavaOnevisionProcessor")
    proc["select_best_resolution"] = best
    me = SimpleNamespace(image_processor=SimpleNamespace(image_grid_pinpoints=[list(p) for p in PINPOINTS]),
                         num_image_tokens=729, vision_aspect_ratio="anyres_max_9")
    me._get_unpadded_features = lambda *a: proc["_get_unpadded_features"](me, *a)
    fam = get_family("llava-ov")
    for h, w in _sizes(random.Random(3), 8, 8000):
        assert fam.image(h, w).n_tokens == proc["_get_number_of_features"](me, h, w, 384, 384), (h, w)


def test_llava_ov_multi_image_and_video_placeholders_match():
    """``replace_image_token`` / ``replace_video_token`` decide the expanded prompt per sample."""
    best = _lift("image_processing_utils.py", "select_best_resolution")["select_best_resolution"]
    proc = _lift("models/llava_onevision/processing_llava_onevision.py", "_get_number_of_features",
                 "_get_unpadded_features", "replace_image_token", "replace_video_token",
                 cls="LlavaOnevisionProcessor")
    proc["select_best_resolution"] = best
    me = SimpleNamespace(image_processor=SimpleNamespace(image_grid_pinpoints=[list(p) for p in PINPOINTS]),
                         num_image_tokens=729, vision_aspect_ratio="anyres_max_9",
                         vision_feature_select_strategy="full", image_token="I", video_token="V")
    for name in ("_get_number_of_features", "_get_unpadded_features"):
        setattr(me, name, (lambda f: lambda *a: f(me, *a))(proc[name]))
    fam = get_family("llava-ov")
    rng = random.Random(6)
    sizes = list(_sizes(rng, 8, 8000))
    crop = SimpleNamespace(shape=(3, 384, 384))  # pixel_values[0][0]: the processed base crop
    pos = multi = 0
    while True:
        counts = [rng.choice((1, 1, 2, 3, 5)) for _ in range(4)]  # a batch of 4 samples
        if pos + sum(counts) > len(sizes):
            break
        batch = sizes[pos: pos + sum(counts)]
        pos += sum(counts)
        inputs = {"batch_num_images": counts, "image_sizes": batch, "pixel_values": [[crop]]}
        image_idx = 0
        for n in counts:
            for h, w in batch[image_idx: image_idx + n]:
                ref = len(proc["replace_image_token"](me, inputs, image_idx))
                assert fam.image_in_sample(h, w, n).n_tokens == ref, (h, w, n)
                image_idx += 1
                multi += n > 1
    assert pos > 900 and multi > 500  # both rules were exercised
    for n_frames in (1, 2, 7, 8, 16, 31, 32, 33, 100, 900):
        videos = {"pixel_values_videos": [SimpleNamespace(shape=(min(n_frames, 32), 3, 384, 384))]}
        ref = len(proc["replace_video_token"](me, videos, 0))
        lay = fam.video(VideoMeta(640, 480, n_frames / 30, 30.0, n_frames))
        assert lay.n_tokens == ref == lay.units * 196 + 1, n_frames


def test_internvl_tiling_matches():
    ns = _lift("models/got_ocr2/image_processing_got_ocr2.py", "get_all_supported_aspect_ratios",
               "get_optimal_tiled_canvas")
    ratios = target_ratios(1, 12)
    for h, w in _sizes(random.Random(4), 8, 8000):
        mine = find_closest_aspect_ratio(w / h, ratios, w, h, 448)
        ref = ns["get_optimal_tiled_canvas"]((h, w), (448, 448), 1, 12)
        assert mine == tuple(ref), (h, w)


def test_molmo2_tiling_matches():
    torch = pytest.importorskip("torch")
    ns = _lift("models/molmo2/image_processing_molmo2.py", "select_tiling")
    ns["select_tiling"].__globals__["torch"] = torch
    for h, w in _sizes(random.Random(5), 8, 8000):
        mine = select_tiling(h - 112, w - 112, 266, 8)
        assert mine == tuple(int(x) for x in ns["select_tiling"](h - 112, w - 112, 266, 8)), (h, w)


@functools.cache
def _hf_molmo2_sampler():
    """``Molmo2VideoProcessor.sample_frames``, lifted from its source."""
    ns = _lift("models/molmo2/video_processing_molmo2.py", "sample_frames", cls="Molmo2VideoProcessor")
    ns["torch"] = pytest.importorskip("torch")
    return ns["sample_frames"]


def _hf_molmo2_frames(n_frames: int, fps: float, num_frames: int) -> list[int]:
    """Frame indices ``Molmo2VideoProcessor.sample_frames`` picks with ``num_frames`` (``max_fps`` 2)."""
    me = SimpleNamespace(max_fps=2, num_frames=num_frames)
    meta = SimpleNamespace(total_num_frames=n_frames, fps=fps, duration=None)
    return [int(i) for i in _hf_molmo2_sampler()(me, meta)]


def _molmo2_frames(n_frames: int, fps: float, max_frames: int = 128) -> list[int]:
    """The frames packtool takes for Molmo2: the frame on screen at each counted time."""
    lay = get_family("molmo2", max_frames=max_frames).video(VideoMeta(64, 48, n_frames / fps, fps, n_frames))
    return [min(int(t * fps + 1e-6), n_frames - 1) for t in lay.timestamps]


def test_molmo2_video_frames_are_transformers_plus_the_last_frame():
    """Where the two samplers agree, and how they differ (the README's Molmo2 video paragraph).

    packtool counts with the released checkpoint's ``uniform_last_frame`` sampler; the
    ``transformers`` port samples ``int(duration * 2)`` frames at ``arange(0, N, N / k)`` and
    never the last frame. Above 2 fps, for a clip of a whole number of half seconds that fits
    128 frames at 2 fps, packtool's frames are the port's (at ``num_frames=128``, the checkpoint's
    setting) plus the last frame.
    """
    for fps in (10, 24, 25, 30, 60):
        for half_seconds in range(1, 128):
            if half_seconds * fps % 2:
                continue  # not a whole number of frames
            n = half_seconds * fps // 2
            hf = _hf_molmo2_frames(n, fps, 128)
            assert _molmo2_frames(n, fps) == [*hf, n - 1], (fps, half_seconds)
    # where they differ: the class default of 64 frames; 1 fps (the port takes every frame, packtool
    # one at each 0.5 s, every frame twice); a clip longer than 63.5 s (the port: 128 of arange,
    # packtool: linspace to the last frame)
    assert len(_hf_molmo2_frames(900, 30, 64)) == 60 and len(_molmo2_frames(900, 30)) == 61
    assert _hf_molmo2_frames(10, 1, 128) == list(range(10))
    assert _molmo2_frames(10, 1) == [0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7, 8, 8, 9, 9, 9]
    hf, mine = _hf_molmo2_frames(1935, 30, 128), _molmo2_frames(1935, 30)
    assert (len(hf), hf[-1], len(mine), mine[-1]) == (128, 1919, 128, 1934)
