"""Regenerate the demo corpus: ``python examples/sample/make_sample.py``.

Writes small PNG/JPEG images of varied sizes (made with Pillow) under ``images/`` and
``data.jsonl`` with 30 LLaVA-style records: single-turn, multi-turn, multi-image,
text-only, placeholder-less, and several Q/A records on the same image. Deterministic.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from PIL import Image, ImageDraw

HERE = Path(__file__).resolve().parent
SIZES = [(640, 480), (1920, 1080), (480, 640), (1024, 1024), (300, 200), (1280, 720), (2000, 600), (56, 56),
         (800, 1200), (333, 517)]
COLOURS = ["red", "green", "blue", "orange", "purple", "teal", "gold", "gray", "pink", "navy"]
SHAPES = ["circle", "square", "triangle"]


def make_images(rng: random.Random) -> list[tuple[str, str, str]]:
    out = []
    (HERE / "images").mkdir(exist_ok=True)
    for i, (w, h) in enumerate(SIZES):
        colour, shape = COLOURS[i], SHAPES[i % 3]
        im = Image.new("RGB", (w, h), "white")
        d = ImageDraw.Draw(im)
        box = (w // 4, h // 4, 3 * w // 4, 3 * h // 4)
        if shape == "circle":
            d.ellipse(box, fill=colour)
        elif shape == "square":
            d.rectangle(box, fill=colour)
        else:
            d.polygon([(w // 2, h // 4), (w // 4, 3 * h // 4), (3 * w // 4, 3 * h // 4)], fill=colour)
        ext = "jpg" if i % 2 else "png"
        name = f"images/img{i:02d}.{ext}"
        im.save(HERE / name, quality=60) if ext == "jpg" else im.save(HERE / name, optimize=True)
        out.append((name, colour, shape))
    return out


def main() -> None:
    rng = random.Random(0)
    imgs = make_images(rng)
    recs = []

    def add(**rec):
        recs.append({"id": f"demo-{len(recs):03d}", **rec})

    for name, colour, shape in imgs:  # 10 single-turn
        add(image=name, conversations=[
            {"from": "human", "value": f"<image>\nWhat shape is shown in the picture?"},
            {"from": "gpt", "value": f"The picture shows a {colour} {shape} on a white background."}])
    for name, colour, shape in imgs[:6]:  # 6 multi-turn
        add(image=name, conversations=[
            {"from": "human", "value": "<image>\nDescribe the image."},
            {"from": "gpt", "value": f"A single {colour} {shape} sits in the middle of a plain white canvas."},
            {"from": "human", "value": "What colour is the shape?"},
            {"from": "gpt", "value": f"It is {colour}."},
            {"from": "human", "value": "Is there any text in the image?"},
            {"from": "gpt", "value": "No, there is no text."}])
    for i in range(4):  # 4 multi-image
        a, b = imgs[i], imgs[i + 5]
        add(image=[a[0], b[0]], conversations=[
            {"from": "human", "value": "Compare <image> and <image>. Which shape is larger?"},
            {"from": "gpt", "value": f"The first shows a {a[1]} {a[2]}, the second a {b[1]} {b[2]}."}])
    for q, a in [("What is 12 times 7?", "12 times 7 is 84."),  # 4 text-only
                 ("Name three primary colours.", "Red, yellow and blue."),
                 ("Translate 'good morning' into French.", "Bonjour."),
                 ("Write a haiku about packing.", "Tokens side by side,\nno padding wasted between:\nthe GPU hums.")]:
        add(conversations=[{"from": "human", "value": q}, {"from": "gpt", "value": a}])
    for name, colour, shape in imgs[6:8]:  # 2 without placeholders (media go first, as LLaVA does)
        add(image=name, conversations=[
            {"from": "human", "value": "Is the background white?"}, {"from": "gpt", "value": "Yes."}])
    name, colour, shape = imgs[2]  # 4 separate Q/A records on one image
    for q, a in [("What colour is the shape?", colour), ("What shape is it?", shape),
                 ("Is the image portrait or landscape?", "portrait"), ("How many shapes are there?", "one")]:
        add(image=name, conversations=[{"from": "human", "value": f"<image>\n{q}"}, {"from": "gpt", "value": a.capitalize() + "."}])
    with open(HERE / "data.jsonl", "w") as fh:
        for r in recs:
            fh.write(json.dumps(r) + "\n")
    print(f"wrote {len(recs)} records and {len(imgs)} images under {HERE}")


if __name__ == "__main__":
    main()
