"""Golden tables: every family's counts for fixed image sizes and videos, derived from the published formulas.

Notation in the comments: ``r(x)`` is Python's banker's ``round``; Qwen budgets are
(min_pixels, max_pixels). Each row pins tokens, vision units, resized size and grid,
so a wrong intermediate step fails even when the final count happens to match.
"""

from __future__ import annotations

import pytest

from packtool.errors import ConfigError, SampleError
from packtool.vision import VideoMeta, get_family

# (height, width) -> (tokens, units, resized (h, w), grid (t, h, w))
QWEN25 = {
    # 1x1: sides floor at 28; 28*28 < 3136 -> beta = sqrt(3136/1) = 56 -> ceil(56/28)*28 = 56 -> 56x56 -> 2*2 = 4
    (1, 1): (4, 16, (56, 56), (1, 4, 4)),
    (10, 10): (4, 16, (56, 56), (1, 4, 4)),  # beta = 5.6 -> ceil(56/28) = 2 -> 56
    (28, 28): (4, 16, (56, 56), (1, 4, 4)),  # 784 < 3136 -> beta = 2 -> 56
    (56, 56): (4, 16, (56, 56), (1, 4, 4)),  # exactly the floor
    (224, 224): (64, 256, (224, 224), (1, 16, 16)),  # 8*8 merged blocks
    (480, 640): (391, 1564, (476, 644), (1, 34, 46)),  # r(17.14)=17 -> 476, r(22.86)=23 -> 644; 17*23
    (1080, 1920): (2691, 10764, (1092, 1932), (1, 78, 138)),  # r(38.57)=39, r(68.57)=69; 39*69
    (1920, 1080): (2691, 10764, (1932, 1092), (1, 138, 78)),
    (333, 777): (336, 1344, (336, 784), (1, 24, 56)),  # r(11.89)=12, r(27.75)=28; 12*28
    # 4000x6000: 143*214*784 > 12845056 -> beta = sqrt(24e6/12845056) = 1.3669 -> floor(104.5)=104, floor(156.8)=156
    (4000, 6000): (16224, 64896, (2912, 4368), (1, 208, 312)),
    (12000, 12000): (16384, 65536, (3584, 3584), (1, 256, 256)),  # beta = 3.348 -> floor(128.0) = 128
    # 100x20000 (ratio 200, allowed): r(3.57)=4 -> 112, r(714.3)=714 -> 19992; 4*714 = 2856
    (100, 20000): (2856, 11424, (112, 19992), (1, 8, 1428)),
    (20000, 100): (2856, 11424, (19992, 112), (1, 1428, 8)),
    (31, 5000): (179, 716, (28, 5012), (1, 2, 358)),  # r(1.107)=1 -> 28, r(178.6)=179 -> 5012
    (1001, 999): (1296, 5184, (1008, 1008), (1, 72, 72)),  # r(35.75)=36, r(35.68)=36
}
QWEN3 = {
    # factor 32, budget (65536, 16777216): tiny images rise to 256x256 = 8*8 merged blocks
    (1, 1): (64, 256, (256, 256), (1, 16, 16)),
    (10, 10): (64, 256, (256, 256), (1, 16, 16)),  # beta = 25.6 -> ceil(8.0) = 8 -> 256
    (28, 28): (64, 256, (256, 256), (1, 16, 16)),
    (56, 56): (64, 256, (256, 256), (1, 16, 16)),
    (224, 224): (64, 256, (256, 256), (1, 16, 16)),  # r(7)=7 -> 224^2 < 65536 -> beta = 1.1429 -> ceil(8.0) = 8
    (480, 640): (300, 1200, (480, 640), (1, 30, 40)),  # 15*20 blocks of 32
    (1080, 1920): (2040, 8160, (1088, 1920), (1, 68, 120)),  # r(33.75)=34, 60; 34*60
    (1920, 1080): (2040, 8160, (1920, 1088), (1, 120, 68)),
    (333, 777): (240, 960, (320, 768), (1, 20, 48)),  # r(10.4)=10, r(24.3)=24
    (4000, 6000): (16224, 64896, (3328, 4992), (1, 208, 312)),  # beta = 1.1961 -> floor(104.5)=104, floor(156.8)=156
    (12000, 12000): (16384, 65536, (4096, 4096), (1, 256, 256)),  # beta = 2.9297 -> 128
    (100, 20000): (1875, 7500, (96, 20000), (1, 6, 1250)),  # r(3.125)=3 -> 96, r(625)=625 -> 20000
    (20000, 100): (1875, 7500, (20000, 96), (1, 1250, 6)),
    (31, 5000): (156, 624, (32, 4992), (1, 2, 312)),  # r(0.97)=1, r(156.25)=156
    (1001, 999): (961, 3844, (992, 992), (1, 62, 62)),  # r(31.28)=31, r(31.22)=31
}
MOLMO2 = {
    # tiling (rows, cols) by select_tiling on (h-112, w-112) with 266-px windows; tokens = 196 + ceil((19r+8)/2)*ceil((19c+8)/2)
    (1, 1): (392, 2, (378, 378), (1, 14, 14)),  # negative size: every scale < 1 -> argmax -> (1,1): 27 patches -> 14x14
    (10, 10): (392, 2, (378, 378), (1, 14, 14)),
    (28, 28): (392, 2, (378, 378), (1, 14, 14)),
    (56, 56): (392, 2, (378, 378), (1, 14, 14)),
    (224, 224): (392, 2, (378, 378), (1, 14, 14)),  # 112x112: (1,1) needs 2.375x, the least upscaling
    (480, 640): (725, 5, (644, 644), (1, 23, 23)),  # 368x528: (2,2) needs 1.0076x -> 46 patches -> 23; 196+529
    (1080, 1920): (1162, 9, (644, 1176), (1, 23, 42)),  # (2,4): 46x84 patches -> 23x42; 196+966
    (1920, 1080): (1162, 9, (1176, 644), (1, 42, 23)),  # (4,2)
    (333, 777): (658, 4, (378, 910), (1, 14, 33)),  # (1,3): 27x65 patches -> 14x33; 196+462
    (4000, 6000): (1162, 9, (644, 1176), (1, 23, 42)),  # all downscale: (2,4) keeps the most (min(532/3888, 1064/5888))
    (12000, 12000): (725, 5, (644, 644), (1, 23, 23)),  # all downscale: (2,2) first of the min-side-2 tilings
    (100, 20000): (392, 2, (378, 378), (1, 14, 14)),  # negative height -> all < 1 -> (1,1)
    (20000, 100): (392, 2, (378, 378), (1, 14, 14)),
    (31, 5000): (392, 2, (378, 378), (1, 14, 14)),
    (1001, 999): (955, 7, (910, 644), (1, 33, 23)),  # 889x887: (3,2) needs 1.004x; 65x46 patches -> 33x23
}
LLAVA_OV = {
    # best pinpoint, then unpadded features + newlines + 729 base; units = 1 + tiles
    (1, 1): (1485, 2, (384, 384), (1, 27, 27)),  # (384,384): 27x27 unpadded, 27 newlines: 729+27+729
    (10, 10): (1485, 2, (384, 384), (1, 27, 27)),
    (28, 28): (1485, 2, (384, 384), (1, 27, 27)),
    (56, 56): (1485, 2, (384, 384), (1, 27, 27)),
    (224, 224): (1485, 2, (384, 384), (1, 27, 27)),
    (480, 640): (2929, 5, (768, 768), (1, 54, 54)),  # 54x54 -> new_h = int(480*54/640) = 40 -> 40*54 + 40 + 729
    (1080, 1920): (7269, 16, (1152, 1920), (1, 81, 135)),  # 81x135 -> h 75 -> ratio 1.28 > 1.1 -> 60*108 + 60 + 729
    (1920, 1080): (7317, 16, (1920, 1152), (1, 135, 81)),  # w 75 -> 135x75 -> ratio 1.28 -> 108*60 + 108 + 729
    (333, 777): (2457, 4, (384, 1152), (1, 27, 81)),  # 27x81: no unpadding (aspect 2.33 < 3) -> 1701 + 27 + 729
    (4000, 6000): (7329, 25, (1536, 2304), (1, 108, 162)),  # 108x162 -> ratio 1.33 -> 81*121... = 6534 + 66 + 729
    (12000, 12000): (7371, 37, (2304, 2304), (1, 162, 162)),  # 162^2 -> ratio 2 -> 81*81 + 81 + 729
    (100, 20000): (892, 7, (384, 2304), (1, 27, 162)),  # 27x162 -> new_h = int(0.81) = 0 -> 1 row: 162 + 1 + 729
    (20000, 100): (1053, 7, (2304, 384), (1, 162, 27)),  # 162x27 -> 1 column: 162 + 162 + 729
    (31, 5000): (892, 7, (384, 2304), (1, 27, 162)),
    (1001, 999): (7371, 10, (1152, 1152), (1, 81, 81)),  # 81x81 -> ratio 1.0 -> 6561 + 81 + 729
}
# A sample with more than one image: no anyres tiling; each image is padded to a square and
# resized to one 384x384 crop -> 27*27 = 729 features + 1 image_newline = 730 tokens, 1 tile
# (transformers LlavaOnevisionProcessor.replace_image_token: num_image_tokens + 1 when the
# sample's batch_num_images != 1; LLaVA-NeXT trains multi-image samples with aspect "pad").
# Independent of size: tiny, huge, extreme aspect and odd sizes all give the same row.
LLAVA_OV_MULTI = {hw: (730, 1, (384, 384), (1, 27, 27)) for hw in LLAVA_OV}
INTERNVL = {
    # (cols, rows) closest to w/h among cols*rows <= 12; tiles = cols*rows (+1 thumbnail when > 1); 256 each
    (1, 1): (256, 1, (448, 448), (1, 16, 16)),  # aspect 1 -> (1,1); tie with (2,2) etc. kept since area is tiny
    (10, 10): (256, 1, (448, 448), (1, 16, 16)),
    (28, 28): (256, 1, (448, 448), (1, 16, 16)),
    (56, 56): (256, 1, (448, 448), (1, 16, 16)),
    (224, 224): (256, 1, (448, 448), (1, 16, 16)),  # 50176 > 0.5*448^2*4? no -> stays (1,1)
    (480, 640): (3328, 13, (1344, 1792), (13, 16, 16)),  # aspect 4/3 exactly -> (4,3) = 12 + thumbnail
    (1080, 1920): (2304, 9, (896, 1792), (9, 16, 16)),  # 1.778: (4,2)=2.0 off by .222, nearest -> 8 + 1
    (1920, 1080): (2304, 9, (1792, 896), (9, 16, 16)),  # 0.5625: (2,4)=0.5 -> 8 + 1
    (333, 777): (2816, 11, (896, 2240), (11, 16, 16)),  # 2.333: (5,2)=2.5 beats (2,1)/(4,2)=2.0 -> 10 + 1
    (4000, 6000): (1792, 7, (896, 1344), (7, 16, 16)),  # 1.5: (3,2) -> 6 + 1
    (12000, 12000): (2560, 10, (1344, 1344), (10, 16, 16)),  # 1.0 ties (1,1),(2,2),(3,3): big area takes (3,3)
    (100, 20000): (3328, 13, (448, 5376), (13, 16, 16)),  # 200: (12,1) -> 12 + 1
    (20000, 100): (3328, 13, (5376, 448), (13, 16, 16)),
    (31, 5000): (3328, 13, (448, 5376), (13, 16, 16)),
    (1001, 999): (2560, 10, (1344, 1344), (10, 16, 16)),  # 0.998: (1,1) diff .002; (2,2),(3,3) tie, area > half -> (3,3)
}
TABLES = {"qwen2.5-vl": QWEN25, "qwen3-vl": QWEN3, "molmo2": MOLMO2, "llava-ov": LLAVA_OV, "internvl": INTERNVL}


@pytest.mark.parametrize("family", sorted(TABLES))
def test_image_golden_table(family):
    fam = get_family(family)
    for (h, w), (tokens, units, resized, grid) in TABLES[family].items():
        lay = fam.image(h, w)
        assert (lay.n_tokens, lay.units, lay.resized, lay.grid) == (tokens, units, resized, grid), (family, h, w)
        assert sum(c for kind, _, c in lay.segments if kind == "pad") == tokens


@pytest.mark.parametrize("n_images", [2, 3, 9])
def test_llava_ov_multi_image_golden_table(n_images):
    fam = get_family("llava-ov")
    for (h, w), (tokens, units, resized, grid) in LLAVA_OV_MULTI.items():
        lay = fam.image_in_sample(h, w, n_images)
        assert (lay.n_tokens, lay.units, lay.resized, lay.grid) == (tokens, units, resized, grid), (n_images, h, w)
        assert lay.segments == (("pad", "<image>", 730),)
    # alone in its sample, an image keeps the anyres_max_9 rule
    assert all(fam.image_in_sample(h, w, 1) == fam.image(h, w) for h, w in LLAVA_OV)
    with pytest.raises(SampleError) as err:
        fam.image_in_sample(0, 640, n_images)
    assert err.value.reason == "corrupt_image"


@pytest.mark.parametrize("family", sorted(set(TABLES) - {"llava-ov"}) + ["qwen2-vl", "fixed:576"])
def test_other_families_ignore_the_sample_image_count(family):
    fam = get_family(family)
    assert fam.image_count_key(3) is None
    for h, w in list(LLAVA_OV)[:8]:
        if max(h, w) / min(h, w) <= 200:
            assert fam.image_in_sample(h, w, 3) == fam.image(h, w)


def test_qwen2_vl_equals_qwen25_for_images():
    a, b = get_family("qwen2-vl"), get_family("qwen2.5-vl")
    assert all(a.image(h, w) == b.image(h, w) for h, w in QWEN25)


def test_qwen_rejects_extreme_aspect_ratio():
    with pytest.raises(SampleError) as err:
        get_family("qwen2.5-vl").image(10, 2011)
    assert err.value.reason == "bad_aspect_ratio"


@pytest.mark.parametrize("family", ["qwen2.5-vl", "qwen3-vl"])
def test_aspect_ratio_rejections_say_what_and_how_far_past_the_limit(family):
    """A ratio just above 200 read as "aspect ratio 200.0 ... exceeds 200", and a video's frames were
    called an image (Qwen2.5-VL) or left unsized (Qwen3-VL): the row's message names the media, its
    size, the ratio rounded up, and the fix."""
    fam = get_family(family)
    for call, what in ((lambda: fam.image(100, 20001), "20001x100 image"),
                       (lambda: fam.video(VideoMeta(20001, 100, 1.0, 10.0, 10)), "20001x100 video")):
        with pytest.raises(SampleError) as err:
            call()
        assert err.value.reason == "bad_aspect_ratio"
        assert err.value.message == (f"aspect ratio 200.01:1 of a {what} is above 200:1, which the Qwen processor "
                                     "rejects; crop or pad it")
    with pytest.raises(SampleError, match=r"250:1 of a 8x2000 video"):
        fam.video(VideoMeta(8, 2000, 1.0, 10.0, 10))


def test_pixel_budget_settings_change_counts():
    # --max-pixels 602112 (768 blocks of 28): 1080x1920 -> beta = 1.8558 -> floor(20.78)=20, floor(36.95)=36
    assert get_family("qwen2.5-vl", max_pixels=602112).image(1080, 1920).n_tokens == 20 * 36
    assert get_family("internvl", max_num=6).image(480, 640).units == 7  # 4/3 not reachable: (3,2)=1.5 nearest, + thumbnail
    assert get_family("molmo2", max_crops=4).image(1080, 1920).units == 1 + 4  # (1,4)


def test_unknown_setting_for_family_is_a_config_error():
    with pytest.raises(ConfigError, match="--max-crops"):
        get_family("qwen2.5-vl", max_crops=4)
    with pytest.raises(ConfigError, match="--exif"):
        get_family("qwen2.5-vl", exif="rotate")


def test_settings_out_of_bounds_are_config_errors_before_the_family_is_built():
    # max_num 5,000 would take hours in the candidate-grid enumeration; refused at once
    with pytest.raises(ConfigError, match=r"^--max-num 5000: choose a value from 1 to 256 "):
        get_family("internvl", max_num=5000)
    with pytest.raises(ConfigError, match=r"^--max-pixels 0: choose a value from 1 to 2,147,483,647 "):
        get_family("qwen3-vl", max_pixels=0)
    with pytest.raises(ConfigError, match=r"^--min-pixels 200 is above --max-pixels 100; "):
        get_family("qwen2-vl", min_pixels=200, max_pixels=100)
    with pytest.raises(ConfigError, match=r"^--model 'fixed:2147483648': fixed:N takes N from 1 to 2,147,483,647 "):
        get_family("fixed:2147483648")
    assert get_family("internvl", max_num=256).max_num == 256
    # one of the two given: the other is the family's default, whatever their order, as the processor takes them
    assert get_family("qwen2.5-vl", min_pixels=20_000_000).min_pixels == 20_000_000


V30 = VideoMeta(1280, 720, 30.0, 30.0, 900)  # 30 s, 30 fps, 1280x720
VSHORT = VideoMeta(64, 48, 0.5, 30.0, 15)  # 0.5 s
VLONG = VideoMeta(32, 32, 600.0, 1.0, 600)  # 10 min at 1 fps
VNTSC = VideoMeta(1920, 1080, 10.01, 30000 / 1001, 300)  # 10 s at 29.97
VONE = VideoMeta(64, 48, 1 / 30, 30.0, 1)  # one frame


def test_qwen25_video_golden():
    fam = get_family("qwen2.5-vl")
    # 900/30*2 = 60 frames; budget max(min(602112, 90316800/60*2), 105369) = 602112 ->
    # 720x1280 -> beta = 1.2372 -> floor(20.8)*28 = 560, floor(36.95)*28 = 1008; 30 * 20 * 36 = 21,600
    lay = fam.video(V30)
    assert (lay.n_tokens, lay.resized, lay.grid, len(lay.timestamps)) == (21600, (560, 1008), (30, 40, 72), 60)
    assert lay.timestamps[0] == 0.0 and lay.timestamps[-1] == 899 / 30  # first and last frame kept
    assert lay.timestamps[1] == 15 / 30  # round(899/59) = round(15.24) = 15
    # 0.5 s: 1 frame at 2 fps -> raised to 4; 48x64 -> 100352 floor: beta = 6.466 -> 280x392; 2 * 10 * 14 = 280
    lay = fam.video(VSHORT)
    assert (lay.n_tokens, lay.resized, lay.grid) == (280, (280, 392), (2, 20, 28))
    assert [round(t * 30) for t in lay.timestamps] == [0, 5, 9, 14]  # r(4.67)=5, r(9.33)=9
    # 10 min at 1 fps: 1200 wanted, capped at 600 frames; 90316800/600*2 = 301056 budget; 32x32 -> 336x336
    lay = fam.video(VLONG)
    assert (lay.n_tokens, lay.grid, len(lay.timestamps)) == (43200, (300, 24, 24), 600)
    assert lay.timestamps == tuple(float(i) for i in range(600))
    # 29.97 fps, 300 frames: 300/29.97*2 = 20.02 -> 20 frames; 1080x1920 -> 560x1008 as above -> 10 * 720
    lay = fam.video(VNTSC)
    assert (lay.n_tokens, lay.grid) == (7200, (10, 40, 72))
    with pytest.raises(SampleError) as err:
        fam.video(VONE)
    assert err.value.reason == "video_too_short"


def test_qwen3_video_golden():
    fam = get_family("qwen3-vl")
    # int(900/30*2) = 60 frames; 3-D budget 25165824 over 60 frames: beta = sqrt(60*720*1280/25165824) = 1.4823
    # -> floor(15.2)*32 = 480, floor(26.98)*32 = 832; 30 temporal patches * 15*26 = 11,700
    lay = fam.video(V30)
    assert (lay.n_tokens, lay.resized, lay.grid) == (11700, (480, 832), (30, 30, 52))
    texts = [v for k, v, _ in lay.segments if k == "text"]
    # frames r(15.24 i): (0, 15) -> 0.25 s -> "0.2" (half-even); (30, 46) -> 1.267; (61, 76) -> 2.283
    assert texts[:3] == ["<0.2 seconds>", "<1.3 seconds>", "<2.3 seconds>"]
    assert len(texts) == 30 and sum(c for k, _, c in lay.segments if k == "pad") == 11700
    lay = fam.video(VSHORT)  # 4 frames (min); 48x64 -> r(1.5)=2 -> 64x64; 2 * 2*2 = 8
    assert (lay.n_tokens, lay.grid, len(lay.timestamps)) == (8, (2, 4, 4), 4)
    lay = fam.video(VLONG)  # 600 frames (<= total); 32x32 fits: 300 patches of 1 token
    assert (lay.n_tokens, lay.grid) == (300, (300, 2, 2))
    # int(20.02) = 20 frames; 20*1088*1920 > 25165824 -> beta = sqrt(20*1080*1920/25165824) = 1.2838
    # -> floor(26.3)*32 = 832, floor(46.7)*32 = 1472; 10 * 26*46 = 11,960
    lay = fam.video(VNTSC)
    assert (lay.n_tokens, lay.resized, lay.grid) == (11960, (832, 1472), (10, 52, 92))
    with pytest.raises(SampleError):
        fam.video(VONE)


def test_molmo2_video_golden():
    fam = get_family("molmo2")
    # 30 s <= 127/2 -> times 0, 0.5, ..., 29.5 (60) + 30.0 = 61 frames of 81 tokens
    lay = fam.video(V30)
    assert (lay.n_tokens, lay.units, len(lay.timestamps)) == (61 * 81, 61, 61)
    assert lay.timestamps[-1] == 30.0 and lay.timestamps[1] == 0.5
    texts = [v for k, v, _ in lay.segments if k == "text"]
    assert texts[:2] == ["0.0 ", " 0.5 "] and texts[-1] == " 30.0 "
    # 600 s > 63.5 -> linspace(0, 600, 128)
    lay = fam.video(VLONG)
    assert len(lay.timestamps) == 128 and lay.timestamps[-1] == 600.0 and lay.units == 128
    assert fam.video(VSHORT).timestamps == (0.0, 0.5)
    assert fam.video(VONE).timestamps == (0.0, 1 / 30)  # last frame always kept


def test_llava_ov_and_internvl_video_golden():
    lo = get_family("llava-ov")
    lay = lo.video(V30)  # 32 frames * 196 + 1 newline
    assert (lay.n_tokens, lay.units, len(lay.timestamps)) == (6273, 32, 32)
    assert lo.video(VSHORT).n_tokens == 15 * 196 + 1  # fewer frames than 32: every frame
    assert lo.video(VONE).n_tokens == 197
    # 600 s at 1 fps: 600 frames -> linspace(0, 599, 32) -> 32 * 14 * 14 + 1 (one newline per video)
    lay = lo.video(VLONG)
    assert (lay.n_tokens, lay.units, lay.grid) == (32 * 196 + 1, 32, (32, 14, 14))
    assert lay.timestamps[:2] == (0.0, 19.0) and lay.timestamps[-1] == 599.0  # int(599/31) = 19
    assert get_family("llava-ov", max_frames=8).video(V30).n_tokens == 8 * 196 + 1
    iv = get_family("internvl")
    lay = iv.video(V30)  # 8 segments of 899/8 = 112.375: int(56.19 + r(112.375 i)), r(449.5) = 450
    assert [round(t * 30) for t in lay.timestamps] == [56, 168, 281, 393, 506, 618, 730, 843]
    assert lay.n_tokens == 8 * 256 and [v for k, v, _ in lay.segments if k == "text"][:2] == ["Frame1: ", "\n"]
    assert get_family("internvl", max_frames=4).video(VLONG).units == 4


def test_llava_ov_rows_count_images_per_sample(tmp_path):
    """End to end: the same file is tiled when alone and one 730-token crop beside another image."""
    from PIL import Image
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from video_fixtures import write_video

    from packtool.records import MediaRef, Message, Part, Sample
    from packtool.rows import EncodeContext, encode_samples
    from packtool.templates import get_template
    from packtool.tokenization import load_tokenizer

    Image.new("RGB", (640, 480), (200, 10, 10)).save(tmp_path / "a.png")
    Image.new("RGB", (1920, 1080), (10, 200, 10)).save(tmp_path / "b.png")
    write_video(tmp_path / "v.mp4", 12)
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<|im_start|>", "<|im_end|>", "<|endoftext|>", "<image>", "<video>"])
    tok.save(str(tmp_path / "tokenizer.json"))
    tokenizer = load_tokenizer(str(tmp_path / "tokenizer.json"))
    image_id, video_id = tokenizer.special_id("<image>"), tokenizer.special_id("<video>")

    def sample(sid, *media):
        parts = tuple(Part.media(kind, i) for i, (kind, _) in enumerate(media)) + (Part.of_text("Describe."),)
        turns = (Message("user", parts), Message("assistant", (Part.of_text("Shapes."),)))
        return Sample(sid, "t.jsonl", 0, tuple(MediaRef(k, p) for k, p in media), (turns,))

    samples = [
        sample("one", ("image", "a.png")),  # alone: anyres 2929 (see LLAVA_OV[(480, 640)])
        sample("two", ("image", "a.png"), ("image", "b.png")),  # 2 images: 730 each
        sample("three", ("image", "b.png"), ("image", "a.png"), ("image", "a.png")),
        sample("img+video", ("image", "b.png"), ("video", "v.mp4")),  # videos do not count: b tiled, 7269
        sample("one again", ("image", "a.png")),  # the probe cache must not hand back the 730 layout
    ]
    for order in (samples, samples[::-1]):  # either case may reach the probe cache first
        ctx = EncodeContext(tokenizer, get_template("chatml"), get_family("llava-ov"), tmp_path)
        rows, rejected = encode_samples(order, ctx)
        assert rejected == []
        got = {r["sample_id"]: r for r in rows}
        expect = {"one": ([2929], 5), "two": ([730, 730], 2), "three": ([730] * 3, 3),
                  "img+video": ([7269, 12 * 196 + 1], 16 + 12), "one again": ([2929], 5)}
        for sid, (spans, units) in expect.items():
            row = got[sid]
            assert [m["n_tokens"] for m in row["media"]] == spans, sid
            assert row["n_vision_units"] == units, sid
            ids = list(row["input_ids"])
            assert ids.count(image_id) + ids.count(video_id) == sum(spans), sid
            for m in row["media"]:
                pad = image_id if m["kind"] == "image" else video_id
                assert ids[m["token_offset"]: m["token_offset"] + m["n_tokens"]] == [pad] * m["n_tokens"], sid
