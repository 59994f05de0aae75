"""The engines a rollout drives, behind one small interface (:class:`EnginePool`).

* :class:`LocalEngines` (here) — a native engine in the rollout's own process, driven on the
  rollout's thread (no HTTP, no second compute thread: the fastest path on a CPU).
* :class:`~relax.rollout.remote_engines.RemoteEngines` — any number of SGLang-compatible URLs
  behind a router, with fail-over, elastic membership and, through its
  :class:`~relax.rollout.engine_supervisor.EngineSupervisor`, engine processes it owns
  replaced when they die.

Both return, per prompt, its ``n`` :class:`~relax.engines.types.Completion` objects, each
carrying the weight version that produced it, and load WeightStore versions in place.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch

from relax.engines.adapter_load import load_into
from relax.engines.native.engine import NativeEngine
from relax.engines.types import Completion, GenerateRequest, SamplingParams
from relax.rollout.prompts import EncodedPrompt
from relax.transfer.adapter_versions import is_adapter_chain, load_version
from relax.transfer.weight_updates import WeightFollower
from relax.transfer.weights import WeightStore


class EnginePool(Protocol):
    """What the rollout needs from its engines."""

    weight_version: int

    def generate(self, prompts: list[EncodedPrompt], params: list[SamplingParams], rids: list[str],
                 should_abort: Callable[[], bool] | None = None) -> list[list[Completion]]:
        """Completions per prompt; ``should_abort()`` polled during generation stops it early
        (finish_reason ``abort``, partial tokens kept) so new weights can be loaded."""
        ...

    def load_weights(self, store: WeightStore, version: int) -> None: ...

    def close(self) -> None: ...


class LocalEngines:
    """A :class:`NativeEngine` on the calling thread."""

    def __init__(self, model: torch.nn.Module, tokenizer: Any, max_batch_size: int, max_seq_len: int, seed: int,
                 record_routes: bool = False):
        self.engine = NativeEngine(model, tokenizer, max_batch_size=max_batch_size, max_seq_len=max_seq_len,
                                   seed=seed, background=False, weight_version="-1", record_routes=record_routes)
        self.weight_version = -1
        self.follower = WeightFollower()

    def generate(self, prompts: list[EncodedPrompt], params: list[SamplingParams], rids: list[str],
                 should_abort: Callable[[], bool] | None = None) -> list[list[Completion]]:
        futures = [self.engine.submit(GenerateRequest(rid, p.input_ids, sp, p.mm_inputs))
                   for p, sp, rid in zip(prompts, params, rids, strict=True)]
        steps = 0
        while self.engine.step():
            steps += 1
            if should_abort is not None and steps % 4 == 0 and should_abort():
                for rid in rids:
                    self.engine.abort(rid)
                while self.engine.step():
                    pass
                break
        return [f.result() for f in futures]

    def load_weights(self, store: WeightStore, version: int) -> None:
        """By the fewest bytes: the deltas from the version it holds, or the version whole (weight_updates);
        an adapter version merged onto its base (relax.engines.adapter_load)."""
        chain = store.chain(version)  # read once: it says which path, and both paths rebuild from it
        if is_adapter_chain(chain):
            load_into(self.engine, load_version(store, version, chain), str(version))
            self.follower.forget()
        else:
            self.follower.update(store, version, self.engine.model.state_dict, self.engine.update_weights,
                                 lambda state: self.engine.update_weights(state, str(version)), chain)
        self.weight_version = version

    def close(self) -> None:
        self.engine.stop()
