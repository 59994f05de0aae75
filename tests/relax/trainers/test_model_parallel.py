"""The seam between the training loop and a backend (relax.trainers.model_parallel): the hooks the loop
looks up are the ones the Protocols document, and the megatron models implement theirs."""

from __future__ import annotations

import inspect

import pytest
import torch

from relax.trainers.model_parallel import HOOKS, LockstepModel, ShardedModel, ShardWriter, hook, unwrap


def members(protocol: type) -> set[str]:
    return {n for n in vars(protocol) if not n.startswith("_")}


def test_a_plain_model_has_no_hook_and_a_wrapper_is_looked_through():
    class Wrapper(torch.nn.Module):
        def __init__(self, module: torch.nn.Module):
            super().__init__()
            self.module = module

    class Sharded(torch.nn.Linear):
        def data_parallel_group(self):
            return "group"

    plain = torch.nn.Linear(2, 2)
    assert all(hook(plain, name) is None for name in HOOKS)
    inner = Sharded(2, 2)
    assert unwrap(Wrapper(Wrapper(inner))) is inner
    assert hook(Wrapper(inner), "data_parallel_group")() == "group"
    with pytest.raises(AttributeError, match="no model-parallel hook"):
        hook(plain, "data_paralel_group")  # a misspelt hook fails instead of reading as "plain data parallel"


def test_the_megatron_models_implement_their_protocols():
    pytest.importorskip("megatron.core")
    from relax.trainers.megatron.policy import MegatronPolicy
    from relax.trainers.megatron.value import MegatronValueModel

    for cls, protocols in ((MegatronPolicy, (ShardedModel, LockstepModel, ShardWriter)),
                           (MegatronValueModel, (ShardedModel,))):
        for protocol in protocols:
            for name in members(protocol):
                mine, theirs = getattr(cls, name, None), getattr(protocol, name)
                assert callable(mine), f"{cls.__name__} lacks {protocol.__name__}.{name}"
                assert list(inspect.signature(mine).parameters) == list(inspect.signature(theirs).parameters), name
