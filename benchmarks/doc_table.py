"""Each benchmark owns one block of docs/benchmarks.md between ``<!-- name:begin/end -->`` markers.

Only ``--update-docs`` runs rewrite it (output.py); other runs write the same block to a file
in the untracked results folder.
"""

from __future__ import annotations

from pathlib import Path

DOC = Path(__file__).resolve().parent.parent / "docs" / "benchmarks.md"


def block_text(name: str, rows: list[str]) -> str:
    """``rows`` between the ``name`` block's markers."""
    return f"<!-- {name}:begin -->\n" + "\n".join(rows) + f"\n<!-- {name}:end -->"


def update_table(name: str, rows: list[str], heading: str) -> None:
    """Replace the ``name`` block with ``rows``; append it under ``heading`` (markdown) the first time."""
    text = DOC.read_text()
    begin, end = f"<!-- {name}:begin -->", f"<!-- {name}:end -->"
    block = block_text(name, rows)
    if begin in text:
        text = text[: text.index(begin)] + block + text[text.index(end) + len(end):]
    else:
        text += f"\n{heading}\n\n{block}\n"
    DOC.write_text(text)
