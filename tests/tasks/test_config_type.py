"""RelaxConfig's Flyte type is flytekit's own, built once per process (tasks/config_type.py)."""

from __future__ import annotations

import typing
from dataclasses import is_dataclass

from flytekit.core.context_manager import FlyteContextManager
from flytekit.core.type_engine import DataclassTransformer, TypeEngine

import tasks  # noqa: F401  (registers the transformer, as importing any task module does)
from relax.config import RelaxConfig, load_config
from tasks.config_type import OnceDataclassTransformer


def test_the_literal_type_is_flytekits_own_and_built_once():
    ours = TypeEngine.to_literal_type(RelaxConfig)
    assert ours.to_flyte_idl() == DataclassTransformer().get_literal_type(RelaxConfig).to_flyte_idl()
    assert TypeEngine.to_literal_type(RelaxConfig) is ours  # the second task interface pays nothing


def test_every_section_has_the_once_built_transformer():
    sections = [t for t in typing.get_type_hints(RelaxConfig).values() if is_dataclass(t)]
    assert len(sections) >= 8  # model, data, rollout, algorithm, trainer, ...
    assert isinstance(TypeEngine.get_transformer(RelaxConfig), OnceDataclassTransformer)
    for t in sections:
        assert isinstance(TypeEngine.get_transformer(t), OnceDataclassTransformer)


def test_a_config_survives_the_wire_unchanged():
    cfg = load_config("tiny-cpu", ["trainer.total_steps=3", "data.tasks=[arithmetic]"])
    ctx = FlyteContextManager.current_context()
    lit = TypeEngine.to_literal(ctx, cfg, RelaxConfig, TypeEngine.to_literal_type(RelaxConfig))
    assert TypeEngine.to_python_value(ctx, lit, RelaxConfig) == cfg
