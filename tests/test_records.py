"""``records``: the fast builders of parts and plain turns make the same objects as the constructors."""

from __future__ import annotations

import dataclasses

import pytest

from packtool.records import MediaRef, Message, Part


@pytest.mark.parametrize("made, built", [
    (Part.of_text("What is it?"), Part("text", "What is it?")),
    (Part.of_text(""), Part("text")),
    (Part.media("video", 3), Part("video", "", 3)),
    (Message.plain("user", (Part.media("image", 0), Part.of_text("Hi"))),
     Message("user", (Part("image", "", 0), Part("text", "Hi")))),
    (Message.plain("assistant", ()), Message("assistant", ())),
    (MediaRef.of_path("image", "coco/1.jpg"), MediaRef("image", "coco/1.jpg")),
])
def test_fast_builders_equal_the_constructors(made, built):
    assert type(made) is type(built)
    assert made == built and hash(made) == hash(built) and repr(made) == repr(built)
    assert dataclasses.asdict(made) == dataclasses.asdict(built)
    name = dataclasses.fields(made)[0].name
    for obj in (made, built):  # still frozen
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(obj, name, "x")


def test_a_different_field_is_a_different_object():
    assert Part.of_text("a") != Part.of_text("b") and Part.media("image", 0) != Part.media("image", 1)
    assert Message.plain("user", ()) != Message("user", (), reasoning="")
    assert MediaRef.of_path("image", "a.jpg") != MediaRef("video", "a.jpg")
