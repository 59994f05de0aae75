"""RelaxConfig's Flyte type, built once per process.

flytekit's dataclass transformer rebuilds a dataclass's literal type (a JSON schema made by
mashumaro, which compiles a serializer class for every field default) each time a task interface
names the type, and again for every section nested in it. Every task here takes a RelaxConfig, so a
pod that imports a task module paid that build once per task in the module: seconds of CPU per pod,
on every pod of a run. The literal type of a class never changes while the process lives, so the
transformer below builds it once per class and hands the same one back; serialization is
flytekit's own, untouched.
"""

from __future__ import annotations

import dataclasses
import typing

from flytekit.core.type_engine import DataclassTransformer, TypeEngine
from flytekit.models.types import LiteralType

from relax.config import RelaxConfig


class OnceDataclassTransformer(DataclassTransformer):
    """flytekit's transformer for one dataclass type, with the literal type built once."""

    def __init__(self, python_type: type) -> None:
        super().__init__()
        self._t = python_type  # what TypeEngine.register keys the transformer by
        self._name = f"Once-{python_type.__name__}"
        self._literal_type: LiteralType | None = None

    def get_literal_type(self, t: type | None = None) -> LiteralType:
        if t is not self._t:  # an Annotated[...] or a subclass: flytekit's way, uncached
            return super().get_literal_type(t)
        if self._literal_type is None:
            self._literal_type = super().get_literal_type(t)
        return self._literal_type


def _dataclasses_in(root: type) -> list[type]:
    """``root`` and every dataclass a field of it holds, depth first, each once."""
    seen: list[type] = []
    todo = [root]
    while todo:
        t = todo.pop()
        if t in seen:
            continue
        seen.append(t)
        hints = typing.get_type_hints(t)
        for f in dataclasses.fields(t):
            for arg in (hints.get(f.name, f.type), *typing.get_args(hints.get(f.name, f.type))):
                if dataclasses.is_dataclass(arg) and isinstance(arg, type):
                    todo.append(arg)
    return seen


def register() -> None:
    """Install the once-built transformer for RelaxConfig and every section in it (idempotent)."""
    for t in _dataclasses_in(RelaxConfig):
        if not isinstance(TypeEngine._REGISTRY.get(t), OnceDataclassTransformer):
            TypeEngine.register(OnceDataclassTransformer(t))
