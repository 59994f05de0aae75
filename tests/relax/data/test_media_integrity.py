"""Dataset rows come from users: media cannot escape the dataset folder, remote media needs an
opt-in, every image and clip is sniffed and size-checked before anything is written, and every
error names the file, line and field (issue 46)."""

from __future__ import annotations

import json
import os
import struct
import zlib

import pytest

from relax import objstore
from relax.config import DataConfig
from relax.data.errors import DataError
from relax.data.readers import read_samples
from relax.data.sources import snapshot_from_config
from tests.media_files import png_bytes, wav_bytes
from tests.relax.data.test_snapshot import PNG


def dataset(folder, images=(), audios=(), files=None) -> DataConfig:
    """``folder/train.jsonl`` with a text row, then one row per media entry (line 2 on), plus
    ``files`` (name -> bytes) written into the folder; the eval split is a text row."""
    for name, data in (files or {}).items():
        objstore.write_bytes(objstore.join(folder, name), data)
    rows = [{"id": "t0", "messages": "1+1?", "answer": "2"}]
    rows += [{"id": f"m{i}", "messages": "<image> ?", "answer": "x", "images": [ref]} for i, ref in enumerate(images)]
    rows += [{"id": f"a{i}", "messages": "<audio> ?", "answer": "x", "audios": [ref]} for i, ref in enumerate(audios)]
    objstore.write_bytes(objstore.join(folder, "train.jsonl"), "".join(json.dumps(r) + "\n" for r in rows).encode())
    objstore.write_bytes(objstore.join(folder, "eval.jsonl"), b'{"id": "e0", "messages": "2+2?", "answer": "4"}\n')
    return DataConfig(train_url=objstore.join(folder, "train.jsonl"), eval_url=objstore.join(folder, "eval.jsonl"))


def refused(data: DataConfig, root, *expected: str) -> str:
    """Snapshotting ``data`` raises a DataError holding every ``expected`` text and writes nothing."""
    with pytest.raises(DataError) as err:
        snapshot_from_config(data, str(root))
    for text in expected:
        assert text in str(err.value), str(err.value)
    assert not root.exists()
    return str(err.value)


@pytest.fixture
def secret(tmp_path):
    """A readable image outside the dataset folder: only the confinement keeps it out."""
    path = tmp_path / "secret.png"
    path.write_bytes(PNG)
    return path


@pytest.mark.parametrize("ref", ["../secret.png", "img/../../secret.png", "ABSOLUTE", "FILE_URL"])
def test_local_media_outside_the_dataset_folder_is_refused(tmp_path, secret, ref):
    ref = {"ABSOLUTE": str(secret), "FILE_URL": f"file://{secret}"}.get(ref, ref)
    data = dataset(str(tmp_path / "src"), images=[ref])
    msg = refused(data, tmp_path / "root", f"{tmp_path / 'src' / 'train.jsonl'}:2: row 'm0' images[0]",
                  f"resolves to {secret}", "outside the dataset folder", "move the file into that folder")
    assert repr(ref) in msg


def test_a_symlink_out_of_the_dataset_folder_is_refused(tmp_path, secret):
    data = dataset(str(tmp_path / "src"), images=["img/link.png"])
    (tmp_path / "src" / "img").mkdir()
    os.symlink(secret, tmp_path / "src" / "img" / "link.png")
    msg = refused(data, tmp_path / "root", "train.jsonl:2: row 'm0' images[0]")
    assert f"resolves to {secret} (links followed)" in msg, msg


def test_media_inside_the_folder_by_any_spelling_is_read(tmp_path):
    src = tmp_path / "src"
    files = {"img/a.png": PNG, "clip.wav": wav_bytes()}
    data = dataset(str(src), images=["img/a.png", str(src / "img" / "a.png"), f"file://{src}/img/./a.png",
                                     "img/link.png", {"path": "img/../img/a.png"}], audios=["clip.wav"], files=files)
    os.symlink(src / "img" / "a.png", src / "img" / "link.png")  # a link that stays inside is fine
    info = snapshot_from_config(data, str(tmp_path / "root"))
    assert info.rows == {"train": 7, "eval": 1} and info.media_files == 2


def test_an_object_store_dataset_keeps_media_under_its_prefix(any_url):
    src = objstore.join(objstore.absolute_url(any_url), "src")
    inside = objstore.join(src, "img", "a.png")
    data = dataset(src, images=["img/a.png", inside], files={"img/a.png": PNG})
    assert [s.images[0].path for s in read_samples(data.train_url) if s.images] == [inside, inside]
    for ref in ("../other/a.png", "/etc/hostname", "file:///etc/hostname"):
        with pytest.raises(DataError, match=r"train.jsonl:2: row 'm0' images\[0\]"):
            list(read_samples(dataset(src, images=[ref]).train_url))


def test_remote_media_without_the_opt_in_is_refused_before_any_fetch(tmp_path, monkeypatch):
    def no_fetch(url):
        raise AssertionError(f"fetched {url}")

    data = dataset(str(tmp_path / "src"), images=["http://127.0.0.1:9/x.png"])
    monkeypatch.setattr(objstore, "read_bytes", no_fetch)  # the rows themselves are read with fsspec.open
    refused(data, tmp_path / "root", "train.jsonl:2: row 'm0' images[0]", "'http://127.0.0.1:9/x.png'",
            "data.allow_remote_media=true")


def test_with_the_opt_in_a_failed_fetch_names_file_line_and_field(tmp_path):
    data = dataset(str(tmp_path / "src"), images=["http://127.0.0.1:9/x.png"])
    data.allow_remote_media = True
    refused(data, tmp_path / "root", f"{tmp_path / 'src' / 'train.jsonl'}:2: row 'm0' images[0]",
            "cannot read media http://127.0.0.1:9/x.png", "check the URL")


@pytest.mark.parametrize(("kind", "blob", "found"), [
    ("images", b"<html>404 not found</html>", "26 bytes starting b'<html>404 not fo'"),
    ("images", b"\x89PNG but not really", "(a PNG signature)"),
    ("images", wav_bytes(), "(a WAV signature)"),
    ("audios", b"fLaC" + bytes(40), "44 bytes starting b'fLaC\\x00"),
    ("audios", PNG, "(a PNG signature)"),
])
def test_bytes_of_the_wrong_kind_are_refused(tmp_path, kind, blob, found):
    data = dataset(str(tmp_path / "src"), files={"m.bin": blob}, **{kind: ["m.bin"]})
    want = "not an image in a format Relax reads" if kind == "images" else "audio must be a PCM WAV file"
    row = "m0" if kind == "images" else "a0"
    msg = refused(data, tmp_path / "root", f"train.jsonl:2: row '{row}' {kind}[0]")
    assert want in msg and found in msg, msg


def png_declaring(width: int, height: int) -> bytes:
    """A 1x1 PNG whose IHDR claims ``width`` x ``height`` (a few dozen bytes, huge once decoded)."""
    small = png_bytes(1, 1)
    ihdr = b"IHDR" + struct.pack(">II", width, height) + small[24:29]
    return small[:12] + ihdr + struct.pack(">I", zlib.crc32(ihdr)) + small[33:]


@pytest.mark.parametrize(("side", "found"), [(12000, "12000x12000 = 144000000 pixels, over data.max_image_pixels"),
                                             (20000, "too large to decode")])
def test_an_image_header_over_the_pixel_limit_is_refused(tmp_path, side, found):
    data = dataset(str(tmp_path / "src"), images=["big.png"], files={"big.png": png_declaring(side, side)})
    msg = refused(data, tmp_path / "root", "train.jsonl:2: row 'm0' images[0]")
    assert found in msg, msg


def test_the_pixel_and_duration_limits_are_config_fields(tmp_path):
    files = {"a.png": png_bytes(4, 4), "a.wav": wav_bytes(seconds=1.0)}
    data = dataset(str(tmp_path / "src"), images=["a.png"], audios=["a.wav"], files=files)
    data.max_image_pixels = 15
    refused(data, tmp_path / "root", "4x4 = 16 pixels, over data.max_image_pixels=15", "raise data.max_image_pixels")
    data.max_image_pixels, data.max_audio_seconds = 16, 0.5
    refused(data, tmp_path / "root", "row 'a0' audios[0]", "1.0 s long, over data.max_audio_seconds=0.5")
    data.max_audio_seconds = 1.0
    assert snapshot_from_config(data, str(tmp_path / "root")).media_files == 2


def test_a_truncated_png_is_refused(tmp_path):
    data = dataset(str(tmp_path / "src"), images=["cut.png"], files={"cut.png": png_bytes(64, 64)[:60]})
    msg = refused(data, tmp_path / "root", "row 'm0' images[0]")
    assert "PNG image is corrupt" in msg, msg


def test_a_non_utf8_jsonl_line_names_file_and_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_bytes(b'{"id": "a", "messages": "q", "answer": "1"}\n' * 3000 +
                     b'{"id": "b", "messages": "caf\xe9", "answer": "2"}\n')
    with pytest.raises(DataError, match=r"bad.jsonl:3001: not UTF-8 text \(byte 0xe9 at column 29\); re-save "
                                        r"bad.jsonl as UTF-8"):
        list(read_samples(str(path)))


def test_a_byte_order_mark_is_not_an_error(tmp_path):
    path = tmp_path / "bom.jsonl"
    path.write_bytes(b'\xef\xbb\xbf{"id": "a", "messages": "q", "answer": "1"}\n')
    assert [s.id for s in read_samples(str(path))] == ["a"]
