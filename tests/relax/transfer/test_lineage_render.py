"""Lineage pictures: the SVG is well-formed with one element per node and edge; the PNG is a real image."""

from __future__ import annotations

import io
import xml.etree.ElementTree as ET

import pytest
from PIL import Image

from relax import objstore
from relax.transfer.lineage import LineageError, LineageRecord, ParentRef
from relax.transfer.lineage_render import layout_chain, render, render_png, render_svg

SVG = "{http://www.w3.org/2000/svg}"


def make_chain(n_a: int = 2, n_b: int = 2) -> list[LineageRecord]:
    """Newest first, like ``chain()``: run-b's checkpoints (dataset ds-b...) continue run-a's (ds-a...)."""
    oldest_first: list[LineageRecord] = []
    parent = None
    for run, n, ds in (("run-a", n_a, "ds-aaaaaaaaaaaaaaaa"), ("run-b", n_b, "ds-bbbbbbbbbbbbbbbb")):
        for i in range(1, n + 1):
            r = LineageRecord(run, f"step-{i * 10:06d}", i * 10, parent, ds, "cfg0123456789ab", "0.1.0",
                              {"rollouts": i}, {i: 32, i + 1: 32}, 1714560000.0 + i)
            oldest_first.append(r)
            parent = ParentRef(r.run_id, r.checkpoint)
    return oldest_first[::-1]


def classes(root: ET.Element, tag: str) -> list[str]:
    return [el.get("class", "") for el in root.iter(SVG + tag)]


def test_svg_has_one_element_per_node_and_edge():
    doc = ET.fromstring(render_svg(make_chain()))
    groups = classes(doc, "g")
    # 4 checkpoints (2 per run) and 2 dataset snapshots.
    assert groups.count("node checkpoint") == 4 and groups.count("node dataset") == 2
    lines = classes(doc, "line")
    # 3 parent edges (every checkpoint but the oldest) and 4 trained_on edges (one per checkpoint).
    assert lines.count("edge parent") == 3 and lines.count("edge trained_on") == 4
    texts = " ".join(t.text or "" for t in doc.iter(SVG + "text"))
    for label in ("step-000020", "step 20", "64 samples (v2-v3)", "run run-b", "ds-bbbbbbbbbbbbbbbb"):
        assert label in texts
    assert "lineage of run-b/step-000020" in texts


def test_svg_escapes_text():
    chain = make_chain(1, 0)
    chain[0].config_hash = "<&>"
    svg = render_svg(chain)
    ET.fromstring(svg)  # would raise on an unescaped '<' or '&'
    assert "&lt;&amp;&gt;" in svg


def test_layout_is_left_to_right_oldest_first_without_overlaps():
    lay = layout_chain(make_chain(3, 3))
    ckpts = [b for b in lay.boxes if b.kind == "checkpoint"]
    assert [b.node_id for b in ckpts][:2] == ["checkpoint:run-a/step-000010", "checkpoint:run-a/step-000020"]
    assert all(a.x + a.w < b.x for a, b in zip(ckpts, ckpts[1:], strict=False))
    datasets = [b for b in lay.boxes if b.kind == "dataset"]
    assert all(a.x + a.w < b.x for a, b in zip(datasets, datasets[1:], strict=False))
    assert all(b.y + b.h < ckpts[0].y for b in datasets)  # datasets sit above the checkpoints
    assert [b.head for b in ckpts] == [False] * 5 + [True]  # the newest is the chain's head


def test_png_opens_and_grows_with_the_chain(tmp_path):
    small, large = tmp_path / "small.png", tmp_path / "large.png"
    render_png(make_chain(1, 1), str(small))
    render_png(make_chain(3, 3), str(large))
    with Image.open(small) as a, Image.open(large) as b:
        assert a.format == b.format == "PNG"
        # A chain is drawn as a row: wider than tall, and more checkpoints make it wider, not taller.
        assert b.width > b.height and b.width > a.width and b.height == a.height
        rgb = b.convert("RGB")
        colours = rgb.getcolors(maxcolors=1 << 20)
        assert colours is not None
        non_white = sum(n for n, c in colours if c != (255, 255, 255))
        assert non_white > 0.05 * b.width * b.height  # boxes, text and arrows, not a blank canvas


def test_render_picks_the_format_by_suffix_on_any_store(any_url):
    chain = make_chain()
    png_url = render(chain, objstore.join(any_url, "pics", "g.PNG"))
    svg_url = render(chain, objstore.join(any_url, "pics", "g.svg"))
    with Image.open(io.BytesIO(objstore.read_bytes(png_url))) as img:
        assert img.format == "PNG"
    assert objstore.read_bytes(svg_url).startswith(b"<svg ")
    with pytest.raises(LineageError, match="name it \\*.png or \\*.svg"):
        render(chain, objstore.join(any_url, "g.jpg"))


def test_empty_chain_is_an_error():
    with pytest.raises(LineageError, match="empty lineage chain"):
        render_svg([])


def test_svg_marks_the_head_and_carries_details_in_tooltips():
    doc = ET.fromstring(render_svg(make_chain()))
    nodes = [g for g in doc.iter(SVG + "g") if g.get("class") == "node checkpoint"]
    widths = [g.find(SVG + "rect").get("stroke-width") for g in nodes]
    assert widths == ["1.5", "1.5", "1.5", "3"]  # oldest first; the head (newest) is drawn thicker
    tip = nodes[-1].find(SVG + "title").text
    assert "config cfg0123456789ab" in tip and "code 0.1.0" in tip and "manifests rollouts@2" in tip
