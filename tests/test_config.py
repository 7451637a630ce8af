"""The frozen configs refuse a bad value from Python as the command line does: a ``ConfigError``
naming the flag and the range, before any work."""

from __future__ import annotations

import pytest

from packtool import PackConfig, TokenizeConfig
from packtool.errors import ConfigError

INT32 = "choose a value from {lo} to 2,147,483,647 (the largest int32, the type of the shards' token, unit and size columns)"
WEIGHT = ("choose a value from 0 to 2,147,483,647 (the largest int32, so a sample's value, the weight times an int32 "
          "count, fits int64)")


@pytest.mark.parametrize(("settings", "message"), [
    ({"max_pixels": 0}, "--max-pixels 0: " + INT32.format(lo=1)),
    ({"max_pixels": -5}, "--max-pixels -5: " + INT32.format(lo=1)),
    ({"min_pixels": 10**23}, f"--min-pixels {10**23}: " + INT32.format(lo=1)),
    ({"min_pixels": 100_000_000, "max_pixels": 10},
     "--min-pixels 100000000 is above --max-pixels 10; give a pixel floor no larger than the cap"),
    ({"model": "fixed:3000000000"}, "--model 'fixed:3000000000': fixed:N takes N from 1 to 2,147,483,647 (the "
                                    "largest int32, the type of the shards' token, unit and size columns), e.g. fixed:576"),
    ({"model": "molmo2", "max_crops": 40000},
     "--max-crops 40000: choose a value from 1 to 256 (far above any released checkpoint's setting)"),
    ({"model": "internvl", "max_num": 1000},
     "--max-num 1000: choose a value from 1 to 256 (far above any released checkpoint's setting)"),
    ({"model": "internvl", "max_frames": 65537},
     "--max-frames 65537: choose a value from 1 to 65,536 (far above any released checkpoint's setting)"),
    ({"fps": float("nan")}, "--fps nan: give a positive video sampling rate, e.g. 2"),
    ({"model": "qwen3-vl", "fps": float("inf")},
     "--fps inf: give a video sampling rate up to 1,000 frames per second (far above any video's frame rate), e.g. 2"),
    ({"max_frames": 1}, "--max-frames 1: --model qwen2.5-vl samples video frames in pairs (temporal patch 2), so "
                        "every video would be rejected; give 2 or more"),
    ({"max_tokens": 3_000_000_000}, "--max-tokens 3000000000: " + INT32.format(lo=1)),
    ({"model": "nope"}, "unknown --model 'nope'; choose one of: internvl, llava-ov, molmo2, qwen2-vl, qwen2.5-vl, "
                        "qwen3-vl, fixed:N"),
    # an argument's byte that is not UTF-8 reaches Python as a lone surrogate (as os.fsdecode gives it)
    ({"system_prompt": "Be brief.\udce9"}, "--system-prompt is not valid UTF-8 text (the same text in a record is "
                                            "rejected as bad_encoding; the tokenizer would have put U+FFFD in its "
                                            "place); write it as UTF-8"),
], ids=["max-pixels-0", "max-pixels-negative", "min-pixels-huge", "min-above-max", "fixed-huge", "max-crops",
        "max-num", "max-frames", "fps-nan", "fps-inf", "qwen-one-frame", "max-tokens", "unknown-model",
        "system-prompt-not-utf8"])
def test_tokenize_config_refuses_a_setting_out_of_bounds(settings, message):
    with pytest.raises(ConfigError) as err:
        TokenizeConfig(**settings)
    assert str(err.value) == message


def test_tokenize_config_takes_the_bounds_themselves():
    TokenizeConfig(min_pixels=1, max_pixels=2**31 - 1, max_tokens=2**31 - 1)
    TokenizeConfig(min_pixels=3136, max_pixels=3136)
    TokenizeConfig(model="fixed:2147483647")
    TokenizeConfig(model="internvl", max_num=256, max_frames=65_536)
    TokenizeConfig(model="molmo2", max_crops=256)
    TokenizeConfig(model="qwen3-vl", max_frames=2, fps=1000)
    TokenizeConfig(model="molmo2", max_frames=1)


def test_a_model_gets_its_own_template_unless_one_is_named(tmp_path):
    """Qwen3-VL and Molmo2 are trained with their own chat formats (no default system prompt,
    Qwen3's tokens; Molmo2's media first): ``--model`` alone must not give them ChatML with
    Qwen2.5's system prompt. The config holds the template used, so its digest names it."""
    from packtool.pipeline import _encode_context

    assert TokenizeConfig().template == "chatml"
    assert TokenizeConfig(model="qwen2-vl").template == "chatml"
    assert TokenizeConfig(model="qwen3-vl").template == "qwen3-vl"
    assert TokenizeConfig(model="molmo2").template == "molmo2"
    assert TokenizeConfig(model="qwen3-vl", template="chatml").template == "chatml"
    assert TokenizeConfig(model="qwen3-vl").digest() == TokenizeConfig(model="qwen3-vl", template="qwen3-vl").digest()
    ctx = _encode_context(TokenizeConfig(model="qwen3-vl", media_root=str(tmp_path)))
    assert ctx.template.default_system == "" and ctx.tokenizer.name == "qwen3"


@pytest.mark.parametrize(("settings", "message"), [
    ({"max_tokens": 2**31}, "--max-tokens 2147483648: " + INT32.format(lo=1)),
    ({"max_vision_units": 10**20}, f"--max-vision-units {10**20}: " + INT32.format(lo=0)),
    ({"text_weight": 2**31}, "--text-weight 2147483648: " + WEIGHT),
    ({"vision_weight": 2**63}, f"--vision-weight {2**63}: " + WEIGHT),
], ids=["max-tokens", "max-vision-units", "text-weight", "vision-weight"])
def test_pack_config_refuses_counts_beyond_int32(settings, message):
    with pytest.raises(ConfigError) as err:
        PackConfig(**settings)
    assert str(err.value) == message


def test_pack_config_takes_int32_counts():
    PackConfig(max_tokens=2**31 - 1, max_vision_units=2**31 - 1, text_weight=2**31 - 1, vision_weight=2**31 - 1)


@pytest.mark.parametrize(("make", "message"), [
    (lambda: PackConfig(max_tokens="8192"), "PackConfig(max_tokens=...) must be an integer, got '8192' (str)"),
    (lambda: PackConfig(max_tokens=8192.5), "PackConfig(max_tokens=...) must be an integer, got 8192.5 (float)"),
    (lambda: PackConfig(buffer_size=True), "PackConfig(buffer_size=...) must be an integer, got True (bool)"),
    (lambda: PackConfig(vision_weight=0.5), "PackConfig(vision_weight=...) must be an integer, got 0.5 (float)"),
    (lambda: PackConfig(max_vision_units="128"),
     "PackConfig(max_vision_units=...) must be an integer or None, got '128' (str)"),
    (lambda: PackConfig(oversize=None), "PackConfig(oversize=...) must be a string, got None (NoneType)"),
    (lambda: TokenizeConfig(rows_per_shard=None),
     "TokenizeConfig(rows_per_shard=...) must be an integer, got None (NoneType)"),
    (lambda: TokenizeConfig(max_errors="5"), "TokenizeConfig(max_errors=...) must be an integer or None, got '5' (str)"),
    (lambda: TokenizeConfig(fps="2"), "TokenizeConfig(fps=...) must be a number or None, got '2' (str)"),
    (lambda: TokenizeConfig(group_by_media="no"), "TokenizeConfig(group_by_media=...) must be True or False, got 'no' (str)"),
    (lambda: TokenizeConfig(model=None), "TokenizeConfig(model=...) must be a string, got None (NoneType)"),
], ids=["str", "float", "bool", "float-weight", "str-or-none", "none", "tok-none", "tok-str", "fps-str", "bool-str",
        "model-none"])
def test_a_setting_of_the_wrong_type_is_a_config_error_naming_it(make, message):
    with pytest.raises(ConfigError) as err:
        make()
    assert str(err.value) == message


def test_numpy_numbers_and_paths_are_the_settings_the_flags_give(tmp_path):
    import json
    from pathlib import Path

    import numpy as np

    from packtool import pack_dataset, tokenize_dataset

    cfg = PackConfig(max_tokens=np.int64(8192), buffer_size=np.int32(8), max_samples_per_pack=np.uint8(4))
    assert cfg == PackConfig(max_tokens=8192, buffer_size=8, max_samples_per_pack=4)
    assert type(cfg.max_tokens) is int and cfg.digest() == PackConfig(max_tokens=8192, buffer_size=8,
                                                                       max_samples_per_pack=4).digest()
    tok = TokenizeConfig(media_root=tmp_path, tokenizer=None, fps=np.float32(2), max_tokens=np.int64(100),
                         group_by_media=np.bool_(True))
    assert tok == TokenizeConfig(media_root=str(tmp_path), fps=2.0, max_tokens=100, group_by_media=True)
    assert type(tok.fps) is float and type(tok.group_by_media) is bool
    # a whole run with numpy settings writes its manifest (np.int64 is no JSON) and resumes with plain ints
    (tmp_path / "data.jsonl").write_text('{"conversations": [{"from": "human", "value": "hi"}, '
                                         '{"from": "gpt", "value": "yes"}]}\n')
    tokenize_dataset([tmp_path / "data.jsonl"], tmp_path / "tok", TokenizeConfig(media_root=tmp_path,
                                                                                 rows_per_shard=np.int64(10)))
    first = pack_dataset(tmp_path / "tok", tmp_path / "packed", cfg)
    assert json.loads((tmp_path / "packed" / ".packtool" / "manifest.json").read_text())["config"]["max_tokens"] == 8192
    again = pack_dataset(Path(tmp_path / "tok"), tmp_path / "packed", PackConfig(max_tokens=8192, buffer_size=8,
                                                                                 max_samples_per_pack=4))
    assert again["config_digest"] == first["config_digest"]
