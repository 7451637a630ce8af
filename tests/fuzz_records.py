"""Record fuzzing for tokenize: valid records of every input format, mutated at random.

:func:`mutants` yields records built from :data:`SEEDS` by a seeded generator: values of the
wrong type anywhere (numbers, lists, objects, null, booleans), missing and extra keys, empty
and huge strings, lone surrogates and odd unicode, NaN / Infinity / huge integers, ``<image>``
and ``<video>`` tags in odd numbers and places, media paths that are absolute, ``..``, URLs,
directories or not media at all, tool calls with broken arguments, reasoning of the wrong type,
unknown roles, turns dropped, repeated and reordered.

:func:`check_run` tokenizes them in-process and holds the run to tokenize's contract: no
exception, every row counted once (``rows_in = samples + rejected``), every rejection a known
reason with a message, and a directory ``validate`` finds whole.

``python tests/fuzz_records.py [N_RECORDS] [SEED ...]`` runs longer campaigns over every family.
"""

from __future__ import annotations

import copy
import json
import math
import random
import sys
from pathlib import Path

from packtool import TokenizeConfig, tokenize_dataset
from packtool.errors import REASON_CODES
from packtool.validate import validate_dir

#: A tiny PNG as a data URI (1x1, RGB), and one whose payload is not an image.
_PNG_1X1 = ("data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAIAAACQd1PeAAAADElEQVR4nGP4z8AAAAMBAQDJ/pLvAAAAAElF"
            "TkSuQmCC")

#: Valid records, one or more per input shape; media names refer to :func:`media_root`'s files.
SEEDS: list[dict] = [
    # LLaVA: an image, a video, a list of images, no tag, text only
    {"id": "llava-1", "image": "a.png", "conversations": [
        {"from": "human", "value": "<image>\nWhat is this?"}, {"from": "gpt", "value": "A picture."}]},
    {"id": "llava-v", "video": "clip.mp4", "conversations": [
        {"from": "human", "value": "<video>\nWhat happens?"}, {"from": "gpt", "value": "Little."},
        {"from": "human", "value": "And then?"}, {"from": "gpt", "value": "Nothing."}]},
    {"id": 7, "image": ["a.png", "b.jpg"], "conversations": [
        {"from": "human", "value": "Compare <image> and <image>."}, {"from": "gpt", "value": "Alike."}]},
    {"image": "b.jpg", "conversations": [{"from": "human", "value": "Describe."}, {"from": "gpt", "value": "Blue."}]},
    {"id": "text", "conversations": [{"from": "human", "value": "Say hi."}, {"from": "gpt", "value": "Hi."}]},
    # ShareGPT (LLaMA-Factory): system, tools, function_call / observation
    {"id": "sg-1", "system": "Be brief.", "images": ["a.png"], "tools": json.dumps(
        [{"name": "lookup", "description": "Look up", "parameters": {"type": "object", "properties": {}}}]),
     "conversations": [
         {"from": "human", "value": "<image>Find it."},
         {"from": "function_call", "value": json.dumps({"name": "lookup", "arguments": {"q": "cat"}})},
         {"from": "observation", "value": "A cat."},
         {"from": "gpt", "value": "It is a cat."}]},
    {"id": "sg-2", "conversations": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}],
     "videos": ["clip.mp4"]},
    # ms-swift: images list, tool_call / tool_response
    {"messages": [{"role": "system", "content": "You help."}, {"role": "user", "content": "<image>What is it?"},
                  {"role": "assistant", "content": "A square."}], "images": ["b.jpg"]},
    {"id": "swift-tools", "tools": [{"type": "function", "function": {"name": "add", "parameters": {}}}],
     "messages": [{"role": "user", "content": "1+1?"},
                  {"role": "tool_call", "content": json.dumps({"name": "add", "arguments": {"a": 1, "b": 1}})},
                  {"role": "tool_response", "content": "2"},
                  {"role": "assistant", "content": "Two."}]},
    # OpenAI: typed parts, image_url, tool_calls with ids, tool results, reasoning
    {"id": "oai-1", "messages": [
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "a.png", "detail": "low"}},
                                     {"type": "text", "text": "What colour?"}]},
        {"role": "assistant", "content": "Grey.", "reasoning_content": "Look at the pixels."}]},
    {"id": "oai-2", "images": ["b.jpg"], "videos": ["clip.mp4"], "messages": [
        {"role": "user", "content": [{"type": "image"}, {"type": "video"}, {"type": "text", "text": "Both?"}]},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "scan", "arguments": "{\"deep\": true}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "done"},
        {"role": "assistant", "content": "<think>ok</think>Both fine."}]},
    {"id": "oai-3", "messages": [
        {"role": "user", "content": [{"type": "image", "image": _PNG_1X1}, {"type": "text", "text": "Tiny?"}]},
        {"role": "assistant", "content": "Yes.", "function_call": {"name": "f", "arguments": {}}},
        {"role": "function", "content": "ok"}, {"role": "assistant", "content": "Done."}]},
    # Molmo / PixMo: one tree
    {"id": "molmo-1", "image": "a.png", "message_list": [
        {"question": "Colour?", "answer": "Grey."}, {"messages": ["How many?", "One.", "Sure?", "Yes."]},
        {"text": "A grey square.", "prompt": "Caption it."}]},
    {"id": "molmo-v", "video": "clip.mp4", "message_list": [{"question": "What?", "answer": "Frames."}]},
    # The Cauldron: images (untagged) before the first question, several exchanges, text only
    {"images": ["a.png", {"bytes": None, "path": "b.jpg"}], "texts": [
        {"user": "Which is bluer?", "assistant": "The second.", "source": "nlvr2"},
        {"user": "Sure?", "assistant": "Yes.", "source": "nlvr2"}]},
    {"id": "cauldron-text", "images": [], "texts": [{"user": "2+2?", "assistant": "4.", "source": "math"}]},
]

_MEDIA_VALUES = ["a.png", "b.jpg", "clip.mp4", "sub", "notes.txt", "empty.png", "/etc/hostname", "../a.png",
                 "sub/../../a.png", "http://example.com/a.png", "https://x/y.mp4", "s3://bucket/a.png", "file:///a.png",
                 "file://otherhost/a.png", "file:///%ff.png", _PNG_1X1, "data:image/png;base64,!!!", "data:,x",
                 "data:image/png;base64,", {"bytes": None, "path": "a.png"}, {"bytes": "aGVsbG8=", "path": None},
                 {"path": None}, {"bytes": 3}, "a.png\x00", "sub\\a.png", ".", "", " ", "\ud800.png", "nope.png"]

_ODD_TEXT = ["", " ", "\n", "<image>", "<video>", "<image><image><image>", "<video><image>", "<image", "<<image>>",
             "</image>", "<think>", "</think>", "<think></think>", "<|im_start|>", "<|im_end|>", "<|image_pad|>",
             "<|vision_start|>", "<tool_call>", "</tool_call>", "<im_patch>", "<IMG_CONTEXT>", "\ud800", "\udfff",
             "a\ud83dz", "\x00", "\u202e\u200b\ufeff", "e\u0301" * 5, "\U0001f600" * 3, "\uffff", "\r\n\t", "%s{0}",
             "null", "[]", "{}", "NaN", "A" * 20_000, "<image>" * 40, "\u0000<video>\u0000"]

_ODD_VALUES = [None, True, False, 0, 1, -1, 2 ** 63, -(2 ** 63) - 1, 10 ** 40, 0.5, -0.0, 1e308, math.nan, math.inf,
               -math.inf, [], {}, [None], [[]], [{}], {"a": 1}, {"from": "human"}, {"role": "user", "content": 3},
               ["x", 1], [1, 2, 3], {"type": "image"}, {"name": "f", "arguments": "{"}]

_ROLES = ["user", "assistant", "system", "tool", "human", "gpt", "observation", "function_call", "tool_call",
          "tool_response", "function", "bot", "USER", "Assistant", "", "narrator", "developer", "model", "ipython"]

_KEYS = ["id", "sample_id", "image", "images", "video", "videos", "conversations", "messages", "message_list",
         "system", "tools", "from", "value", "role", "content", "type", "text", "tool_calls", "tool_call_id",
         "function_call", "reasoning_content", "function", "arguments", "name", "question", "answer", "prompt", "url",
         "image_url", "path", "bytes", "base64", "objects", "texts", "user", "assistant", "source"]


def _args_values() -> list:
    return ["{", "[]", "null", "1", "\"s\"", "{\"a\": NaN}", "{\"a\": 1e999}", "{\"a\": \"\\ud800\"}", [], 3, None,
            {"a": math.nan}, {"a": [1, {"b": None}]}, {"\ud800": 1}, "{\"a\": 1}{", ""]


def _containers(value, path=()):
    """Every (path, value) inside ``value``, the root included."""
    yield path, value
    if isinstance(value, dict):
        for k, v in value.items():
            yield from _containers(v, path + (k,))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from _containers(v, path + (i,))


def _get(root, path):
    for p in path:
        root = root[p]
    return root


def _odd_value(rng: random.Random, key=None):
    roll = rng.random()
    if key in ("image", "images", "video", "videos", "url", "path", "image_url") and roll < 0.6:
        v = copy.deepcopy(rng.choice(_MEDIA_VALUES))
        return [v, copy.deepcopy(rng.choice(_MEDIA_VALUES))] if rng.random() < 0.3 else v
    if key == "arguments" and roll < 0.7:
        return rng.choice(_args_values())
    if key in ("role", "from") and roll < 0.7:
        return rng.choice(_ROLES)
    if roll < 0.5:
        return rng.choice(_ODD_TEXT)
    return copy.deepcopy(rng.choice(_ODD_VALUES))


def mutate(record: dict, rng: random.Random) -> dict:
    """One to four random changes to a deep copy of ``record``; half the time only its strings,
    media entries, roles and arguments change (the record keeps its shape and gets further in)."""
    rec = copy.deepcopy(record)
    gentle = rng.random() < 0.5
    for _ in range(rng.randint(1, 4)):
        spots = list(_containers(rec))
        path, value = rng.choice(spots)
        op = rng.random()
        if gentle:
            if isinstance(value, str) and path:
                if path[-1] in ("image", "images", "video", "videos", "url", "path", "role", "from", "arguments") \
                        or (len(path) > 1 and path[-2] in ("image", "images", "video", "videos")):
                    value = _odd_value(rng, path[-1] if isinstance(path[-1], str) else path[-2])
                else:
                    cut = rng.randrange(len(value) + 1)
                    value = value[:cut] + rng.choice(_ODD_TEXT) + value[cut:]
                _get(rec, path[:-1])[path[-1]] = value
            continue
        if isinstance(value, dict) and op < 0.35:
            if value and rng.random() < 0.5:
                del value[rng.choice(list(value))]  # a key missing
            else:
                k = rng.choice(_KEYS)
                value[k] = _odd_value(rng, k)  # a key added (or replaced)
        elif isinstance(value, list) and op < 0.35:
            r = rng.random()
            if value and r < 0.3:
                value.pop(rng.randrange(len(value)))
            elif value and r < 0.6:
                value.insert(rng.randrange(len(value) + 1), copy.deepcopy(rng.choice(value)))
            elif r < 0.8:
                rng.shuffle(value)
            else:
                value.insert(rng.randrange(len(value) + 1), _odd_value(rng))
        elif isinstance(value, str) and op < 0.5:
            cut = rng.randrange(len(value) + 1)
            value = value[:cut] + rng.choice(_ODD_TEXT) + value[cut:]
            if path:
                _get(rec, path[:-1])[path[-1]] = value
        elif path:
            _get(rec, path[:-1])[path[-1]] = _odd_value(rng, path[-1])
        elif not isinstance(rec, dict):
            break
    return rec


def mutants(seed: int, n: int) -> list:
    """``n`` records: every seed record once, then mutants of them; now and then a whole record of
    another type (a list, a string, null)."""
    rng = random.Random(seed)
    out: list = [copy.deepcopy(r) for r in SEEDS]
    while len(out) < n:
        if rng.random() < 0.02:
            out.append(copy.deepcopy(rng.choice(_ODD_VALUES)))
        else:
            out.append(mutate(rng.choice(SEEDS), rng))
    return out[:n]


def media_root(root: Path) -> Path:
    """Real media the seed records name: two images, a short video, a directory, a text file, an empty file."""
    from PIL import Image
    from video_fixtures import write_video

    root.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", (64, 48), (120, 120, 120)).save(root / "a.png")
    Image.new("RGB", (40, 56), (10, 20, 200)).save(root / "b.jpg")
    write_video(root / "clip.mp4", n_frames=8, fps=4, size=(32, 32))
    (root / "sub").mkdir(exist_ok=True)
    (root / "sub" / "a.png").write_bytes((root / "a.png").read_bytes())
    (root / "notes.txt").write_text("not an image\n")
    (root / "empty.png").write_bytes(b"")
    return root


#: The tool and reasoning markers the templates add, which the test vocabulary must hold too.
TOOL_SPECIALS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>"]

#: ``--model`` → tokenize settings; the families outside Qwen take the byte-level test vocabulary.
FAMILIES = {
    "qwen2.5-vl": {"template": "chatml", "max_pixels": 64 * 28 * 28},
    "qwen3-vl": {"template": "qwen3-vl", "max_pixels": 64 * 32 * 32},
    "molmo2": {"template": "molmo2", "max_crops": 2, "max_frames": 2},
    "internvl": {"max_num": 2, "max_frames": 2},
    "llava-ov": {"template": "plain", "max_frames": 2},
}


def write_jsonl(path: Path, records: list) -> Path:
    with open(path, "w", encoding="utf-8") as fh:
        for r in records:
            fh.write(json.dumps(r) + "\n")  # NaN / Infinity as JSON's common extension writes them
    return path


def check_run(inputs: list[Path], out: Path, media: Path, family: str, vocab: Path | None, **extra) -> dict:
    """Tokenize ``inputs`` and check the contract; returns the manifest."""
    settings = {**FAMILIES[family], **extra}
    tokenizer = None if family.startswith("qwen") else str(vocab)
    cfg = TokenizeConfig(model=family, tokenizer=tokenizer, media_root=str(media), rows_per_shard=64, **settings)
    m = tokenize_dataset(inputs, out, cfg, workers=1)
    c = m["counts"]
    assert c["rows_in"] == c["samples"] - c["split_extra_trees"] + c["merged_records"] + c["rejected"], c
    errors = [json.loads(line) for line in (out / ".packtool" / "errors.jsonl").read_text(encoding="utf-8").splitlines()]
    assert len(errors) == c["rejected"], (len(errors), c)
    for e in errors:
        assert e["reason"] in REASON_CODES and e["message"], e
    report = validate_dir(out, tokenizer=tokenizer)
    assert report["ok"], report["problems"]
    return m


def _campaign(n: int, seeds: list[int], dump: bool = False) -> None:  # pragma: no cover - the long run, by hand
    import tempfile
    import traceback
    from collections import Counter

    sys.path.insert(0, str(Path(__file__).parent))
    from hf_harness import FAMILY_SPECIALS, byte_tokenizer

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        media = media_root(tmp / "media")
        vocab = byte_tokenizer(tmp / "tok", sorted({*FAMILY_SPECIALS, *TOOL_SPECIALS}))
        for seed in seeds:
            records = mutants(seed, n)
            src = write_jsonl(tmp / f"in-{seed}.jsonl", records)
            arr = tmp / f"in-{seed}.json"
            arr.write_text(json.dumps(records, indent=1))
            variants = {"jsonl": ([src], {}), "array+group": ([arr], {"group_by_media": True}),
                        "caps": ([src], {"max_branches": 2, "max_tokens": 80, "system_prompt": "<image>\ud800"[:7]})}
            for family in FAMILIES:
                for vname, (inputs, extra) in variants.items():
                    if FAMILIES[family].get("template") == "plain":  # a template with no system text refuses one
                        extra = {k: v for k, v in extra.items() if k != "system_prompt"}
                    out = tmp / f"out-{seed}-{family}-{vname}"
                    try:
                        m = check_run(inputs, out, media, family, vocab, **extra)
                        print(seed, family, vname, m["counts"]["samples"], dict(Counter(m["counts"]["rejected_by_reason"])))
                        if dump:
                            for line in (out / ".packtool" / "errors.jsonl").read_text().splitlines():
                                e = json.loads(line)
                                print("  ", e["row"], e["reason"], e["message"][:160])
                    except Exception:  # noqa: BLE001 - shown, then the next family
                        print(f"seed {seed} family {family} {vname}: FAILED")
                        traceback.print_exc()

if __name__ == "__main__":  # pragma: no cover
    dump = "--dump" in sys.argv
    args = [int(a) for a in sys.argv[1:] if a != "--dump"]
    _campaign(args[0] if args else 500, args[1:] or [0], dump)
