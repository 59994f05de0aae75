"""Draw a lineage chain as a picture (SVG or PNG) with no graphviz or matplotlib.

Why hand-made: the picture is needed wherever a run's root is readable (a laptop, a CI
job, a Flyte task), and graph layout libraries are heavy native dependencies. A chain is
a line, so the layout is simple: checkpoints left to right, oldest first, each with a
"parent" arrow to its left neighbour; dataset snapshots in a row above, each over the
checkpoints trained on it, with dashed "trained_on" arrows up to it. One layout serves
both formats, so the SVG and the PNG always show the same graph (``chain_to_json``'s).
"""

from __future__ import annotations

import io
import math
from dataclasses import dataclass, field
from xml.sax.saxutils import escape, quoteattr

from relax import objstore
from relax.transfer.lineage import LineageError, LineageRecord, chain_to_json, policy_label

CHAR_W = 7.5  # px per character of 12px monospace text, used to size boxes
LINE_H = 16
MARGIN, GAP, ROW_GAP, TITLE_H, LEGEND_H = 24, 56, 64, 28, 28
RUN_COLOURS = [("#dbeafe", "#1d4ed8"), ("#dcfce7", "#15803d"), ("#fef3c7", "#b45309"),
               ("#fce7f3", "#be185d"), ("#ede9fe", "#6d28d9"), ("#e0f2fe", "#0369a1")]
DATASET_COLOURS = ("#f3f4f6", "#4b5563")
EDGE_COLOURS = {"parent": "#111827", "trained_on": "#6b7280"}


@dataclass
class Box:
    """A node: top-left corner, size, text lines (the first is the title) and colours."""

    node_id: str
    kind: str
    x: float
    y: float
    w: float
    h: float
    lines: list[str]
    fill: str
    stroke: str
    head: bool = False
    tooltip: str = ""


@dataclass
class Edge:
    kind: str
    x1: float
    y1: float
    x2: float
    y2: float


@dataclass
class Layout:
    width: int
    height: int
    title: str
    boxes: list[Box] = field(default_factory=list)
    edges: list[Edge] = field(default_factory=list)


def layout_chain(records: list[LineageRecord]) -> Layout:
    """Positions of every node and edge of ``chain_to_json(records)``, in pixels."""
    if not records:
        raise LineageError("cannot draw an empty lineage chain")
    graph = chain_to_json(records)
    by_key = {r.key: r for r in records}
    run_colour = {run: RUN_COLOURS[i % len(RUN_COLOURS)] for i, run in enumerate(dict.fromkeys(
        r.run_id for r in reversed(records)))}
    ckpt_nodes = [n for n in graph["nodes"] if n["kind"] == "checkpoint"]
    ds_nodes = [n for n in graph["nodes"] if n["kind"] == "dataset"]
    ckpt_lines = {n["id"]: _checkpoint_lines(by_key[n["id"].split(":", 1)[1]]) for n in ckpt_nodes}
    ckpt_w = max(150.0, max(len(s) for ls in ckpt_lines.values() for s in ls) * CHAR_W + 24)
    ckpt_h = 4 * LINE_H + 16
    ds_h = 2 * LINE_H + 14
    ds_y = MARGIN + TITLE_H
    ck_y = ds_y + ds_h + ROW_GAP
    boxes: dict[str, Box] = {}
    for i, node in enumerate(ckpt_nodes):
        record = by_key[node["id"].split(":", 1)[1]]
        fill, stroke = run_colour[record.run_id]
        boxes[node["id"]] = Box(node["id"], "checkpoint", MARGIN + i * (ckpt_w + GAP), ck_y, ckpt_w, ckpt_h,
                                ckpt_lines[node["id"]], fill, stroke, head=record.key == graph["head"],
                                tooltip=_tooltip(record))
    trained = [e for e in graph["edges"] if e["kind"] == "trained_on"]
    right = MARGIN
    for node in ds_nodes:
        users = [boxes[e["from"]] for e in trained if e["to"] == node["id"]]
        lines = ["dataset snapshot", node["snapshot"]]
        w = max(150.0, max(map(len, lines)) * CHAR_W + 24)
        centre = (users[0].x + users[-1].x + users[-1].w) / 2
        x = max(centre - w / 2, right)  # pushed right so dataset boxes never overlap
        boxes[node["id"]] = Box(node["id"], "dataset", x, ds_y, w, ds_h, lines, *DATASET_COLOURS,
                                tooltip=node["snapshot"])
        right = x + w + GAP / 2
    edges = []
    for e in graph["edges"]:
        src, dst = boxes[e["from"]], boxes[e["to"]]
        if e["kind"] == "parent":  # from the child's left side to the parent's right side
            edges.append(Edge("parent", src.x, src.y + src.h / 2, dst.x + dst.w, dst.y + dst.h / 2))
        else:  # from the checkpoint's top up to the dataset's bottom, vertical where possible
            top_x = src.x + src.w / 2
            end_x = min(max(top_x, dst.x + 12), dst.x + dst.w - 12)
            edges.append(Edge("trained_on", top_x, src.y, end_x, dst.y + dst.h))
    width = max(b.x + b.w for b in boxes.values()) + MARGIN
    title = f"lineage of {graph['head']}"
    width = max(width, len(title) * CHAR_W + 2 * MARGIN, 380)
    height = ck_y + ckpt_h + 12 + LEGEND_H + MARGIN / 2
    return Layout(math.ceil(width), math.ceil(height), title, list(boxes.values()), edges)


def _checkpoint_lines(record: LineageRecord) -> list[str]:
    return [record.checkpoint, f"step {record.step}",
            f"{record.sample_count} samples ({policy_label(record)})", f"run {record.run_id}"]


def _tooltip(record: LineageRecord) -> str:
    manifests = ", ".join(f"{t}@{v}" for t, v in sorted(record.manifest_versions.items())) or "-"
    return (f"{record.key} step {record.step}; dataset {record.dataset_snapshot}; config {record.config_hash}; "
            f"code {record.code_version}; manifests {manifests}")


def render_svg(records: list[LineageRecord]) -> str:
    """A standalone SVG document: one ``<g class="node ...">`` per node, one ``<line class="edge ...">`` per edge."""
    lay = layout_chain(records)
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{lay.width}" height="{lay.height}" '
           f'viewBox="0 0 {lay.width} {lay.height}" font-family="monospace" font-size="12">',
           "<defs>"]
    for kind, colour in EDGE_COLOURS.items():
        out.append(f'<marker id="arrow-{kind}" viewBox="0 0 10 10" refX="10" refY="5" markerWidth="8" '
                   f'markerHeight="8" orient="auto-start-reverse"><path d="M0,0 L10,5 L0,10 z" fill="{colour}"/>'
                   f"</marker>")
    out.append("</defs>")
    out.append('<rect class="background" width="100%" height="100%" fill="#ffffff"/>')
    out.append(f'<text class="title" x="{MARGIN}" y="{MARGIN + 12}" font-size="14" font-weight="bold">'
               f"{escape(lay.title)}</text>")
    for edge in lay.edges:
        dash = ' stroke-dasharray="6,4"' if edge.kind == "trained_on" else ""
        out.append(f'<line class="edge {edge.kind}" x1="{edge.x1:.1f}" y1="{edge.y1:.1f}" x2="{edge.x2:.1f}" '
                   f'y2="{edge.y2:.1f}" stroke="{EDGE_COLOURS[edge.kind]}" stroke-width="1.5"{dash} '
                   f'marker-end="url(#arrow-{edge.kind})"/>')
    for i, box in enumerate(lay.boxes):
        out.append(f'<g class="node {box.kind}" id="{box.kind}-{i}" data-node={quoteattr(box.node_id)}>')
        out.append(f"<title>{escape(box.tooltip)}</title>")
        out.append(f'<rect x="{box.x:.1f}" y="{box.y:.1f}" width="{box.w:.1f}" height="{box.h:.1f}" rx="6" '
                   f'fill="{box.fill}" stroke="{box.stroke}" stroke-width="{3 if box.head else 1.5}"/>')
        for j, line in enumerate(box.lines):
            weight = ' font-weight="bold"' if j == 0 else ""
            out.append(f'<text x="{box.x + box.w / 2:.1f}" y="{box.y + 8 + (j + 0.75) * LINE_H:.1f}" '
                       f'text-anchor="middle"{weight}>{escape(line)}</text>')
        out.append("</g>")
    legend_y = lay.height - MARGIN / 2 - LEGEND_H / 2
    for k, (kind, label) in enumerate((("parent", "parent checkpoint"), ("trained_on", "trained on"))):
        x = MARGIN + k * 200
        dash = ' stroke-dasharray="6,4"' if kind == "trained_on" else ""
        out.append(f'<line class="legend {kind}" x1="{x + 40}" y1="{legend_y}" x2="{x}" y2="{legend_y}" '
                   f'stroke="{EDGE_COLOURS[kind]}" stroke-width="1.5"{dash} marker-end="url(#arrow-{kind})"/>')
        out.append(f'<text class="legend" x="{x + 48}" y="{legend_y + 4}">{escape(label)}</text>')
    out.append("</svg>")
    return "\n".join(out) + "\n"


def render_png_bytes(records: list[LineageRecord], scale: float = 2.0) -> bytes:
    """The same layout drawn with PIL at ``scale`` pixels per layout unit (2 = sharp on hi-dpi screens)."""
    from PIL import Image, ImageDraw, ImageFont  # only PNG output needs PIL

    lay = layout_chain(records)
    img = Image.new("RGB", (math.ceil(lay.width * scale), math.ceil(lay.height * scale)), "white")
    draw = ImageDraw.Draw(img)
    font = ImageFont.load_default(size=round(12 * scale))
    bold = ImageFont.load_default(size=round(13 * scale))

    def s(v: float) -> float:
        return v * scale

    draw.text((s(MARGIN), s(MARGIN + 12)), lay.title, fill="black", font=bold, anchor="ls")
    for edge in lay.edges:
        _arrow(draw, [s(edge.x1), s(edge.y1), s(edge.x2), s(edge.y2)], EDGE_COLOURS[edge.kind],
               dashed=edge.kind == "trained_on", scale=scale)
    for box in lay.boxes:
        draw.rounded_rectangle([s(box.x), s(box.y), s(box.x + box.w), s(box.y + box.h)], radius=s(6),
                               fill=box.fill, outline=box.stroke, width=max(1, round(s(3 if box.head else 1.5))))
        for j, line in enumerate(box.lines):
            draw.text((s(box.x + box.w / 2), s(box.y + 8 + (j + 0.75) * LINE_H)), line, fill="black",
                      font=bold if j == 0 else font, anchor="ms")
    legend_y = lay.height - MARGIN / 2 - LEGEND_H / 2
    for k, (kind, label) in enumerate((("parent", "parent checkpoint"), ("trained_on", "trained on"))):
        x = MARGIN + k * 200
        _arrow(draw, [s(x + 40), s(legend_y), s(x), s(legend_y)], EDGE_COLOURS[kind],
               dashed=kind == "trained_on", scale=scale)
        draw.text((s(x + 48), s(legend_y + 4)), label, fill="black", font=font, anchor="ls")
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def _arrow(draw, xy: list[float], colour: str, dashed: bool, scale: float) -> None:
    """A line from (x1, y1) to (x2, y2), solid or dashed, with a filled head at the end."""
    x1, y1, x2, y2 = xy
    length = math.hypot(x2 - x1, y2 - y1) or 1.0
    ux, uy = (x2 - x1) / length, (y2 - y1) / length
    head = 9 * scale
    width = max(1, round(1.5 * scale))
    if dashed:
        on, off, pos = 6 * scale, 4 * scale, 0.0
        while pos < length - head:
            end = min(pos + on, length - head)
            draw.line([x1 + ux * pos, y1 + uy * pos, x1 + ux * end, y1 + uy * end], fill=colour, width=width)
            pos += on + off
    else:
        draw.line([x1, y1, x2 - ux * head, y2 - uy * head], fill=colour, width=width)
    bx, by = x2 - ux * head, y2 - uy * head
    px, py = -uy * head * 0.45, ux * head * 0.45
    draw.polygon([(x2, y2), (bx + px, by + py), (bx - px, by - py)], fill=colour)


def render_png(records: list[LineageRecord], path_or_url: str, scale: float = 2.0) -> str:
    """Write the PNG to a local path or any fsspec URL; returns the absolute URL written."""
    url = objstore.absolute_url(path_or_url)
    objstore.write_bytes(url, render_png_bytes(records, scale))
    return url


def render(records: list[LineageRecord], url: str) -> str:
    """Write an SVG or a PNG, chosen by the suffix of ``url``; returns the absolute URL written."""
    lower = url.lower()
    if lower.endswith(".png"):
        return render_png(records, url)
    if lower.endswith(".svg"):
        target = objstore.absolute_url(url)
        objstore.write_bytes(target, render_svg(records).encode())
        return target
    raise LineageError(f"cannot tell the picture format of {url!r}: name it *.png or *.svg")
