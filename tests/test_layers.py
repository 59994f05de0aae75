"""The import graph of relax/, tasks/ and workflows/: no cycles, arrows only down the layers
of docs/architecture.md.

Every import statement counts, function-local ones included: a local import that dodges a cycle
at import time is still a cycle in the design.
"""

from __future__ import annotations

import ast
import dataclasses
import re
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# docs/architecture.md's layers ("The six layers"), top (1) to bottom; the entry points (the CLI and
# the pipeline the Flyte tasks call) sit between the tasks and the services, and the config and the
# object-store helpers are the foundation every layer reads. Longest prefix wins.
LAYERS = {
    "workflows": 1, "tasks": 2,
    "relax.cli": 2.5, "relax.pipeline": 2.6,
    "relax.services": 3,
    "relax.rollout": 4, "relax.trainers": 4,
    "relax.algorithms": 5, "relax.models": 5, "relax.engines": 5,
    "relax.transfer": 6, "relax.data": 6,
    "relax.config": 7, "relax.objstore": 7, "relax": 7,
}


def layer(module: str) -> float:
    best = max((p for p in LAYERS if module == p or module.startswith(p + ".")), key=len)
    return LAYERS[best]


def modules() -> dict[str, Path]:
    out = {}
    for top in ("relax", "tasks", "workflows"):
        for path in (REPO / top).rglob("*.py"):
            name = ".".join(path.relative_to(REPO).with_suffix("").parts)
            out[name.removesuffix(".__init__")] = path
    return out


def imports(name: str, path: Path) -> set[str]:
    """Every name an import statement in the module names, relative imports resolved."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            found.add(base)
            found.update(f"{base}.{a.name}" for a in node.names)
    return found


def graph() -> dict[str, set[str]]:
    mods = modules()

    def resolve(n: str) -> str | None:
        while n and n not in mods:
            n = n.rpartition(".")[0]
        return n or None

    edges: dict[str, set[str]] = defaultdict(set)
    for name, path in mods.items():
        for target in filter(None, map(resolve, imports(name, path))):
            if target != name and not name.startswith(target + "."):  # a package's own __init__ is not an arrow
                edges[name].add(target)
    return edges


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def test_cycle_finder_finds_a_cycle():
    # a -> b -> c -> a is one cycle; d -> a hangs off it
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycles():
    assert cycles(graph()) == []


def test_arrows_point_down_the_layers():
    up = sorted(f"{m} ({layer(m)}) -> {t} ({layer(t)})" for m, ts in graph().items() for t in ts
                if layer(t) < layer(m))
    assert up == []


def test_the_training_backends_import_nothing_of_each_other():
    # one trainer, the backend plugged in (relax.trainers.model_parallel): what both backends use lives in
    # backend-neutral modules under relax/trainers/ (packing, checkpoint, model_parallel), never in the other
    backends = ("relax.trainers.torch", "relax.trainers.megatron")

    def backend(module: str) -> str | None:
        return next((b for b in backends if module == b or module.startswith(b + ".")), None)

    crossing = sorted(f"{m} -> {t}" for m, ts in graph().items() for t in ts
                      if backend(m) and backend(t) and backend(m) != backend(t))
    assert crossing == []


def test_algorithms_are_pure_tensor_math():
    # docs/architecture.md: relax.algorithms imports no Ray, Flyte or fsspec, and nothing of relax above it
    found = {imp.split(".")[0] for name, path in modules().items() if name.startswith("relax.algorithms")
             for imp in imports(name, path)}
    assert not found & {"ray", "fsspec", "s3fs", "flytekit", "flytekitplugins"}
    relax_imports = {imp for name, path in modules().items() if name.startswith("relax.algorithms")
                     for imp in imports(name, path) if imp.startswith("relax")}
    assert all(i.startswith("relax.algorithms") for i in relax_imports), relax_imports


def test_no_module_in_relax_is_over_400_lines():
    long = {str(p.relative_to(REPO)): n for p in (REPO / "relax").rglob("*.py")
            if (n := len(p.read_text().splitlines())) > 400}
    assert long == {}


# -- config checks have one home -------------------------------------------------------------------
#
# A *config check* is a ``raise ConfigError(...)`` statement whose message text (its string literals,
# the formatted values left out) names a field of the config as ``section.field`` (``rollout.api_port``,
# ``trainer.sft_steps``), outside an ``except`` handler. Such a raise refuses a config value; every
# one lives in relax/config/ (the loader's checks beside their section, the cross-section ones in
# relax/config/cross.py, the environment's in relax/config/preflight.py, those over built things in
# relax/config/fit.py). A raise inside an ``except`` handler only converts another layer's error
# into a ConfigError (a port taken, no Ray cluster): its check is where that error was raised.


def config_fields() -> set[str]:
    """Every ``section.field`` of the config tree."""
    from relax.config import RelaxConfig

    cfg, out = RelaxConfig(), set()
    for s in dataclasses.fields(cfg):
        section = getattr(cfg, s.name)
        if dataclasses.is_dataclass(section):
            out |= {f"{s.name}.{f.name}" for f in dataclasses.fields(section)}
    return out


def config_checks(tree: ast.AST, fields: set[str]) -> list[int]:
    """The lines of the config checks (see above) in a module's syntax tree."""
    found: list[int] = []

    def visit(node: ast.AST, in_handler: bool) -> None:
        if isinstance(node, ast.Raise) and not in_handler and isinstance(node.exc, ast.Call):
            func = node.exc.func
            name = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else ""
            text = " ".join(c.value for arg in node.exc.args for c in ast.walk(arg)
                            if isinstance(c, ast.Constant) and isinstance(c.value, str))
            if name == "ConfigError" and fields & set(re.findall(r"\b[a-z_]+\.[a-z_]+\b", text)):
                found.append(node.lineno)
        for child in ast.iter_child_nodes(node):
            visit(child, in_handler or isinstance(node, ast.ExceptHandler))

    visit(tree, False)
    return found


def test_the_config_check_finder_finds_one():
    fields = {"rollout.api_port", "trainer.sft_steps"}
    src = """
def f(cfg):
    if cfg.rollout.api_port:
        raise ConfigError(f"rollout.api_port={cfg.rollout.api_port} needs HTTP engines")
    try:
        g()
    except OSError as e:
        raise ConfigError(f"rollout.api_port: {e}") from None
    raise ConfigError("no run under this root")
    raise ValueError("trainer.sft_steps is wrong")
"""
    assert config_checks(ast.parse(src), fields) == [4]
    assert {"rollout.api_port", "trainer.sft_steps", "model.family"} <= config_fields()


def test_every_config_check_lives_in_relax_config():
    fields = config_fields()
    outside = sorted(f"{name}:{line}" for name, path in modules().items() if not layer_is_config(name)
                     for line in config_checks(ast.parse(path.read_text()), fields))
    assert outside == [], "config checks outside relax/config/ (move them there; see config_checks above)"


def layer_is_config(module: str) -> bool:
    return module == "relax.config" or module.startswith("relax.config.")
