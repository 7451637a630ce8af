"""Qwen3-VL vision accounting, reproduced from the released processor.

Images: the Qwen2-VL rule with 16-px patches and 2x2 merge, so sides are multiples
of 32; the released ``preprocessor_config.json`` budget is 65,536 .. 16,777,216 px.

Videos follow ``Qwen3VLVideoProcessor`` with the released
``video_preprocessor_config.json`` (fps 2, min_frames 4, max_frames 768, pixel budget
4,096 .. 25,165,824 over *all* frames, per-frame cap off):

* ``n = int(n_frames / video_fps * 2)`` clamped to ``[4, 768]`` and to ``n_frames``;
  frame indices ``round(linspace(0, n_frames - 1, n))``;
* the whole clip is resized by the 3-D ``smart_resize``: with ``t = round(n / 2) * 2``,
  if ``t * H' * W'`` exceeds the budget, ``beta = sqrt(n * H * W / max_pixels)``;
* an odd ``n`` is padded with the last frame, so ``grid_t = ceil(n / 2)``;
* each temporal patch is laid out as ``<{t:.1f} seconds>`` text (the mean time of
  its two frames), ``<|vision_start|>``, ``H'W'/1024`` ``<|video_pad|>``, ``<|vision_end|>``.

    >>> lay = Qwen3VL().video(VideoMeta(1280, 720, 10.0, 30.0, 300))
    >>> len(lay.timestamps), lay.grid, lay.n_tokens
    (20, (10, 44, 80), 8800)

``video_sampler="qwen-vl-utils"`` (``--video-sampler qwen-vl-utils``) counts a video as the
Qwen team's ``qwen_vl_utils.fetch_video(..., image_patch_size=16)`` prepares it, the path of
most Qwen3-VL training recipes, which hand the processor the frames it resized with
``do_resize=False`` and sampling off:

* ``n = n_frames / video_fps * 2`` clamped to ``[4, floor2(min(768, n_frames))]`` and to
  ``n_frames``, then floored to an even number (:func:`~packtool.vision.qwen.smart_nframes`);
  the same ``round(linspace(0, n_frames - 1, n))`` indices;
* each frame resized *alone* by the 2-D ``smart_resize`` (factor 32) with a per-frame floor of
  128 tokens (131,072 px) and a cap of ``max(min(786,432, 117,964,800 / n * 2), 137,625)`` px,
  768 tokens a frame up to 300 frames (:func:`~packtool.vision.qwen.video_frame_pixels`);
* the same timestamp text, ``index / fps`` of each frame pair.

A short clip gets fewer tokens than the processor gives it, a long one more:

    >>> capped = Qwen3VL(video_sampler="qwen-vl-utils")
    >>> capped.video(VideoMeta(1280, 720, 10.0, 30.0, 300)).grid
    (10, 40, 72)
    >>> Qwen3VL().video(VideoMeta(1280, 720, 2.0, 30.0, 60)).n_tokens, capped.video(VideoMeta(1280, 720, 2.0, 30.0, 60)).n_tokens
    (1760, 1440)
"""

from __future__ import annotations

import math

from ..errors import SampleError
from . import VIDEO_SAMPLERS, VideoMeta, VisionLayout, check_video, check_video_sampler
from .qwen import MAX_RATIO, Qwen2VL, aspect_ratio_error, uniform_indices

__all__ = ["Qwen3VL", "smart_resize_video", "frame_pair_times"]


def smart_resize_video(n_frames: int, height: int, width: int, temporal_factor: int = 2, factor: int = 32,
                       min_pixels: int = 4096, max_pixels: int = 25165824) -> tuple[int, int]:
    """Qwen3-VL's 3-D resize: the pixel budget covers all ``n_frames`` frames.

    Example:
        >>> smart_resize_video(20, 720, 1280)
        (704, 1280)
    """
    if n_frames < temporal_factor:
        raise SampleError("video_too_short", f"{n_frames} frame(s) sampled; Qwen3-VL needs at least {temporal_factor}")
    given = (height, width)
    if height < factor or width < factor:
        # tiny frames are scaled up to one factor first (processor behaviour)
        scale = max(factor / height, factor / width)
        height, width = int(height * scale), int(width * scale)
    if max(height, width) / min(height, width) > MAX_RATIO:
        # named by its own size; the ratio is the processor's, of the frames scaled up
        raise aspect_ratio_error(*given, "video" if (height, width) == given else
                                 f"video (frames scaled up to {factor} px first, as the processor does)",
                                 max(height, width) / min(height, width))
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    t_bar = round(n_frames / temporal_factor) * temporal_factor
    if t_bar * h_bar * w_bar > max_pixels:
        beta = math.sqrt((n_frames * height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif t_bar * h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (n_frames * height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def frame_pair_times(indices: list[int], video_fps: float, merge: int = 2) -> list[float]:
    """Mean time of the frames in each temporal patch (the processor's ``_calculate_timestamps``).

    Example:
        >>> frame_pair_times([0, 15, 30], 30.0)
        [0.25, 1.0]
    """
    idx = list(indices)
    if len(idx) % merge:
        idx.extend(idx[-1] for _ in range(merge - len(idx) % merge))
    ts = [i / video_fps for i in idx]
    return [(ts[i] + ts[i + merge - 1]) / 2 for i in range(0, len(ts), merge)]


class Qwen3VL(Qwen2VL):
    """Qwen3-VL: 16-px patches, 2x2 merge, temporal patch 2, timestamp text per temporal patch.

    Images follow the Qwen2-VL rule with the 32-px factor:

        >>> Qwen3VL().image(1080, 1920).n_tokens
        2040
    """

    name = "qwen3-vl"
    unit_name = "patches"
    patch = 16
    merge = 2
    temporal_patch = 2
    default_max_vision_units = 65536
    exif_default = "ignore"

    def __init__(self, min_pixels: int = 65536, max_pixels: int = 16777216, max_frames: int = 768,
                 fps: float = 2.0, video_sampler: str = "processor") -> None:
        self.min_pixels = int(min_pixels)
        self.max_pixels = int(max_pixels)
        self.max_frames = int(max_frames)
        self.fps = float(fps)
        self.min_frames = 4
        self.video_min_pixels = 4096
        self.video_max_pixels = 25165824
        check_video_sampler(video_sampler)
        self.video_sampler = video_sampler

    def settings(self) -> dict:
        """The counting settings; ``video_sampler`` only when it is not the processor's (a run
        without ``--video-sampler`` records what earlier versions recorded).

        Example:
            >>> Qwen3VL(video_sampler="qwen-vl-utils").settings()["video_sampler"]
            'qwen-vl-utils'
            >>> "video_sampler" in Qwen3VL().settings()
            False
        """
        out = super().settings()
        if self.video_sampler != VIDEO_SAMPLERS[0]:
            out["video_sampler"] = self.video_sampler
        return out

    def video(self, meta: VideoMeta) -> VisionLayout:
        if self.video_sampler == "qwen-vl-utils":
            idx_array, (rh, rw) = self.qwen_vl_utils_frames(meta)
            idx, n = idx_array.tolist(), len(idx_array)
        else:
            check_video(meta, self.name, self.temporal_patch)
            n = int(meta.n_frames / meta.fps * self.fps)
            n = min(max(n, self.min_frames), self.max_frames, meta.n_frames)
            idx = uniform_indices(meta.n_frames, n).tolist()
            rh, rw = smart_resize_video(n, meta.height, meta.width, self.temporal_patch, self.factor,
                                        self.video_min_pixels, self.video_max_pixels)
        gt = math.ceil(n / self.temporal_patch)
        gh, gw = rh // self.patch, rw // self.patch
        per_t = gh * gw // (self.merge * self.merge)
        # the timestamp text is the processor's (index / fps); the recorded times are when those
        # frames are shown, which differ from it in a variable-rate video
        text_times = tuple(i / meta.fps for i in idx)
        times = tuple(meta.frame_time(i) for i in idx)
        return VisionLayout("video", gt * per_t, gt * gh * gw, (gt, gh, gw), (rh, rw),
                            self.video_segments((gt, gh, gw), text_times), times)

    def segment_times(self, media: dict) -> tuple[float, ...]:
        """The times the timestamp text of a recorded video is written from: ``index / fps``
        of its sampled frames, rebuilt from the recorded frame count and rate (the recorded
        timestamps are when the frames are shown, which differ in a variable-rate video).

        Example:
            >>> Qwen3VL().segment_times({"timestamps": [0.0, 0.01, 0.9, 2.0], "source_fps": 10.0,
            ...                          "source_frames": 20})
            (0.0, 0.6, 1.3, 1.9)
        """
        ts = tuple(media.get("timestamps") or ())
        fps, n_frames = media.get("source_fps"), media.get("source_frames")
        if not ts or not fps or not n_frames:  # a schema 5 row: its timestamps are index / fps
            return ts
        return tuple(int(i) / float(fps) for i in uniform_indices(int(n_frames), len(ts)))

    def video_segments(self, grid: tuple[int, int, int], timestamps: tuple[float, ...]) -> tuple:
        """Per temporal patch: its mean time as text, then its ``<|video_pad|>`` run between markers.

        ``timestamps`` are the sampled frames' ``index / fps`` (:meth:`segment_times` of a
        recorded video), so the pair means equal :func:`frame_pair_times` of the indices.

        Example:
            >>> [s[1] for s in Qwen3VL().video_segments((1, 2, 2), (0.0, 0.5))]
            ['<0.2 seconds>', '<|vision_start|>', '<|video_pad|>', '<|vision_end|>']
        """
        ts = list(timestamps)
        m = self.temporal_patch
        if len(ts) % m:
            ts.extend(ts[-1] for _ in range(m - len(ts) % m))
        per_t = grid[1] * grid[2] // (self.merge * self.merge)
        segs: list[tuple[str, str, int]] = []
        for i in range(0, len(ts), m):
            t = (ts[i] + ts[i + m - 1]) / 2
            segs += [("text", f"<{t:.1f} seconds>", 1), ("special", "<|vision_start|>", 1),
                     ("pad", "<|video_pad|>", per_t), ("special", "<|vision_end|>", 1)]
        return tuple(segs)
