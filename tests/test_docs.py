"""The docs name files and modules that exist: a moved or deleted one fails here, not in a reader's hands.

Checked: every repository path (``relax/foo/bar.py``, ``tests/...``, ``docs/...``) and every dotted
``relax.*`` name in README.md, CONTRIBUTING.md, docs/*.md and the docstrings and comments of relax/,
tasks/ and workflows/; and that neither the docs nor the prose of any Python file in the repository
names a file outside it (a clone must stand alone). A failure lists every broken reference as file:line.
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from collections.abc import Iterator
from functools import cache
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# a repository path: starts at a top-level folder (not inside ./.relax/... or a URL), ends in a file
# or folder name
PATH = re.compile(r"(?<![\w./-])(relax|tests|benchmarks|tasks|workflows|infra|docs)/[\w./-]*\w")
# a dotted name in the package: relax.services.driver, ~relax.rollout.sessions.SessionHub
DOTTED = re.compile(r"(?<![\w./-])relax(?:\.\w+)+")
# a file outside the repository: a parent-relative path into a folder (../shared/x.md; a bare ../name is
# an example of a refused path), or a path on the machine the code was written on
OUTSIDE = re.compile(r"(?<![\w.])(?:\.\./)+[\w.-]+/|(?<![\w/.-])/work/\w")
CODE = ("relax", "tasks", "workflows")


def named_paths(text: str) -> set[str]:
    return {m.group(0) for m in PATH.finditer(text)}


def markdown_files() -> list[Path]:
    # docs/history/ records the past as it was
    return [p for p in (REPO / "README.md", REPO / "CONTRIBUTING.md", *sorted((REPO / "docs").glob("*.md")))
            if p.exists()]


def code_files() -> list[Path]:
    return sorted(p for top in CODE for p in (REPO / top).rglob("*.py"))


@cache
def prose_lines(path: Path) -> list[tuple[int, str]]:
    """(line number, text) of a file's prose: every line of markdown; a Python file's comments and
    docstrings (its other strings are data, e.g. a URL under a run root)."""
    return sorted(_prose_lines(path))


def _prose_lines(path: Path) -> Iterator[tuple[int, str]]:
    text = path.read_text()
    if path.suffix != ".py":
        yield from enumerate(text.splitlines(), 1)
        return
    for tok in tokenize.generate_tokens(io.StringIO(text).readline):
        if tok.type == tokenize.COMMENT:
            yield tok.start[0], tok.string
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) \
                    and isinstance(first.value.value, str):
                for i, line in enumerate(ast.get_source_segment(text, first).splitlines()):
                    yield first.lineno + i, line


def module_file(dotted: str) -> Path | None:
    base = REPO.joinpath(*dotted.split("."))
    return next((p for p in (base.with_suffix(".py"), base / "__init__.py") if p.is_file()), None)


def _bound(body: list[ast.stmt]) -> dict[str, ast.AST]:
    """The names a module or class body binds, each with its node (a def, a class, or the statement)."""
    names: dict[str, ast.AST] = {}
    for node in body:
        if isinstance(node, (ast.If, ast.Try)):  # `if TYPE_CHECKING:`, `try: import x`
            names.update(_bound(node.body + getattr(node, "orelse", []) + getattr(node, "finalbody", [])
                                + [s for h in getattr(node, "handlers", []) for s in h.body]))
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names[node.name] = node
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            for target in getattr(node, "targets", None) or [node.target]:
                for n in ast.walk(target):
                    if isinstance(n, ast.Name):
                        names[n.id] = node
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            for alias in node.names:
                names[alias.asname or alias.name.split(".")[0]] = node
    return names


@cache
def module_names(path: Path) -> dict[str, ast.AST]:
    return _bound(ast.parse(path.read_text()).body)


def class_names(cls: ast.ClassDef) -> set[str]:
    """A class's attributes: its body's names and whatever its methods set on ``self``."""
    names = set(_bound(cls.body))
    for node in ast.walk(cls):
        if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) \
                and isinstance(node.value, ast.Name) and node.value.id == "self":
            names.add(node.attr)
    return names


def resolves(dotted: str) -> bool:
    """``relax.a.b`` is a module, or a module followed by a name it binds (and, for a class defined
    there, an attribute of that class); anything deeper is not checked."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        path = module_file(".".join(parts[:cut]))
        if path is None:
            continue
        rest = parts[cut:]
        if not rest:
            return True
        node = module_names(path).get(rest[0])
        if node is None:
            return False
        return len(rest) == 1 or not isinstance(node, ast.ClassDef) or rest[1] in class_names(node)
    return False


def broken_references(files: list[Path], check) -> list[str]:
    return [f"{path.relative_to(REPO)}:{line}: {ref}" for path in files for line, text in prose_lines(path)
            for ref in check(text)]


def _report(kind: str, broken: list[str]) -> str:
    return f"{len(broken)} {kind} (file:line: reference):\n" + "\n".join(broken)


def test_path_pattern():
    text = "see `relax/services/driver.py`, tests/test_docs.py::test_x, ./.relax/runs/x and s3://b/relax/y"
    assert named_paths(text) == {"relax/services/driver.py", "tests/test_docs.py"}
    assert [m.group(0) for m in DOTTED.finditer("`relax.pipeline`, :mod:`~relax.data.samples`. ./.relax.x")] \
        == ["relax.pipeline", "relax.data.samples"]
    assert OUTSIDE.search("(../shared/DESIGN.md)") and OUTSIDE.search("/work/main/x")
    assert not OUTSIDE.search("runs/../x.py") and not OUTSIDE.search("`../secret` is refused; a..b or ...")


def test_resolves_modules_names_and_class_attributes():
    assert resolves("relax.pipeline") and resolves("relax.services") and resolves("relax.objstore.join")
    assert resolves("relax.transfer.queue.TransferQueue") and resolves("relax.transfer.columns.Field.shape")
    assert not resolves("relax.no_such_module") and not resolves("relax.objstore.no_such_name")
    assert not resolves("relax.transfer.columns.Field.no_such_attribute")


def test_every_path_the_docs_name_exists():
    broken = broken_references(markdown_files() + code_files(),
                               lambda text: sorted(p for p in named_paths(text) if not (REPO / p).exists()))
    assert broken == [], _report("paths that do not exist", broken)


def test_every_relax_name_the_docs_use_resolves():
    broken = broken_references(markdown_files() + code_files(),
                               lambda text: sorted({m.group(0) for m in DOTTED.finditer(text)
                                                    if not resolves(m.group(0))}))
    assert broken == [], _report("dotted relax names that name no module or name in it", broken)


def test_nothing_names_a_file_outside_the_repository():
    # the prose of every Python file: tests hold "../" paths as data (path traversal must be refused)
    files = markdown_files() + sorted(p for top in (*CODE, "tests", "benchmarks", "infra", "examples")
                                      for p in (REPO / top).rglob("*.py") if p != Path(__file__).resolve())
    broken = broken_references(files, lambda text: [m.group(0) for m in OUTSIDE.finditer(text)])
    assert broken == [], _report("references to files outside the repository", broken)


def test_architecture_names_every_module():
    text = (REPO / "docs" / "architecture.md").read_text()
    modules = sorted(str(p.relative_to(REPO)) for top in CODE
                     for p in (REPO / top).rglob("*.py") if p.name != "__init__.py")
    assert [m for m in modules if m not in text] == []
