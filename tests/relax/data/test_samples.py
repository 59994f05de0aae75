"""Sample schema: parsing, placeholders, media references."""

from __future__ import annotations

import base64

import pytest

from relax.data.errors import DataError
from relax.data.samples import MediaRef, Sample


def row(**kw):
    base = {"id": "r1", "messages": [{"role": "user", "content": "<image> what colour?"}],
            "images": ["a.png"], "answer": "red"}
    base.update(kw)
    return base


def test_round_trip_keeps_every_field():
    s = Sample.from_json(row(metadata={"k": 1}, task="shapes", audios=[{"bytes_b64": "AAE="}],
                             messages=[{"role": "system", "content": "be brief"},
                                       {"role": "user", "content": "<image><audio> both?"}]), "t:1")
    assert s.images == (MediaRef(path="a.png"),)
    assert s.audios == (MediaRef(data=b"\x00\x01"),)
    assert s.modality == "omni"
    assert s.prompt_text == "<image><audio> both?"
    assert Sample.from_json(s.to_json(), "t:2") == s


def test_string_messages_are_one_user_turn():
    s = Sample.from_json({"id": 3, "messages": "2+2?", "answer": 4}, "t:1")
    assert s.messages[0].role == "user" and s.messages[0].content == "2+2?"
    assert (s.id, s.answer, s.modality) == ("3", "4", "text")


def test_media_ref_forms():
    raw = b"\x89PNGxyz"
    assert MediaRef.from_json(raw, "w").data == raw
    assert MediaRef.from_json({"bytes_b64": base64.b64encode(raw).decode()}, "w").data == raw
    assert MediaRef.from_json({"path": "s3://b/x.png", "sha256": "ab"}, "w") == MediaRef(path="s3://b/x.png",
                                                                                          sha256="ab")
    with pytest.raises(DataError, match="exactly one"):
        MediaRef(path="a", data=b"b")
    with pytest.raises(DataError, match="w: a media reference must be"):
        MediaRef.from_json(3, "w")
    with pytest.raises(DataError, match="not valid base64"):
        MediaRef.from_json({"bytes_b64": "!!"}, "w")


@pytest.mark.parametrize(
    "bad, fragment",
    [
        (row(images=[]), "has 1 <image> placeholder(s) but 0 image(s)"),
        (row(audios=["x.wav"]), "has 0 <audio> placeholder(s) but 1 audio(s)"),
        ({"id": "x", "answer": "1"}, "missing required field(s) ['messages']"),
        (row(messages=[]), "'messages' must be a non-empty list"),
        (row(messages=[{"role": "robot", "content": "<image>"}]), "messages[0].role is 'robot'"),
        (row(messages=[{"role": "user", "content": ["<image>"]}]), "messages[0].content must be a string"),
        (row(metadata=[1]), "'metadata' must be an object"),
        ([1, 2], "a row must be a JSON object"),
    ],
)
def test_bad_rows_name_the_location(bad, fragment):
    with pytest.raises(DataError) as err:
        Sample.from_json(bad, "data.jsonl:7")
    assert str(err.value).startswith("data.jsonl:7")
    assert fragment in str(err.value)


def test_a_misspelled_field_is_named_with_the_one_meant():
    # `image` for `images` used to be dropped without a word, leaving only the placeholder count to complain
    bad = {k: v for k, v in row().items() if k != "images"} | {"image": ["img/x.png"]}
    with pytest.raises(DataError, match=r"data.jsonl:7: unknown field\(s\) 'image' \(did you mean 'images'\?\); "
                                        r".*move extra information under 'metadata'"):
        Sample.from_json(bad, "data.jsonl:7")
    with pytest.raises(DataError, match=r"'Answer' \(did you mean 'answer'\?\), 'source'"):
        Sample.from_json(row() | {"Answer": "2", "source": "web"}, "data.jsonl:7")


def test_the_index_column_pandas_writes_is_not_a_field():
    assert Sample.from_json(row() | {"__index_level_0__": 3}, "data.parquet#row3").id == row()["id"]
