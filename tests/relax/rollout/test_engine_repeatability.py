"""Runs with engine processes repeat bit for bit (issue 46, b).

What made them differ: the rollout sent each sample as its own HTTP request, and the engine's
scheduler thread started on whatever had arrived when it woke. Which requests shared a batch,
and so the padded shapes and the last bits of every logprob (and now and then a sampled
token), depended on arrival timing. Now a pool call goes as one batched request per engine,
and an engine admits a batch's requests together, as the in-process engine admits a step's:
an HTTP engine in this process answers bit for bit what the in-process engine answers, and
two runs with an engine process end on the same samples and the same weights.
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from relax.engines.server import build_native_engine, create_app
from relax.engines.types import GenerateRequest, SamplingParams
from relax.rollout.engine_pool import LocalEngines
from relax.rollout.prompts import EncodedPrompt
from relax.rollout.remote_engines import RemoteEngines, _by_size, _request_bytes, _shares
from relax.services.driver import train
from relax.transfer.queue import TransferQueue
from relax.transfer.weights import WeightStore
from tests.relax.engines.contract import InProcessServer, save_tiny_model
from tests.relax.services.runtime_helpers import tiny_config

SEED = 3


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_model(Path(tmp_path_factory.mktemp("repeat")) / "model")


def _prompts(n: int = 16) -> tuple[list[EncodedPrompt], list[SamplingParams], list[str]]:
    prompts = [EncodedPrompt([5 + (i * 7 + j) % 200 for j in range(3 + i % 9)], None, [], []) for i in range(n)]
    params = [SamplingParams(max_new_tokens=12, temperature=1.0, sampling_seed=1000 + i) for i in range(n)]
    return prompts, params, [f"r{i}" for i in range(n)]


@pytest.fixture
def fast_thread_switches():
    """Hand the GIL over as often as possible, so a scheduler thread that could wake between two
    requests of one batch does."""
    before = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    yield
    sys.setswitchinterval(before)


def served_runs(engine, model_dir, prompts, params, rids, **pool_kwargs) -> list:
    """Three generate calls of one pool over HTTP to ``engine`` (started here, stopped by the caller)."""
    with InProcessServer(create_app(engine.start(), str(model_dir))) as srv:
        remote = RemoteEngines([srv.url], **pool_kwargs)
        try:
            return [remote.generate(prompts, params, rids) for _ in range(3)]
        finally:
            remote.close()


def test_an_http_engine_answers_a_batch_bit_for_bit_like_the_in_process_engine(model_dir, fast_thread_switches):
    prompts, params, rids = _prompts()
    engine, _ = build_native_engine(str(model_dir), max_batch_size=16, seed=SEED)  # its own scheduler thread
    local = LocalEngines(engine.model, engine.tokenizer, max_batch_size=16, max_seq_len=64, seed=SEED)
    try:
        here = local.generate(prompts, params, rids)
        runs = served_runs(engine, model_dir, prompts, params, rids)
    finally:
        engine.stop()
        local.close()
    for there in runs:
        for a, b in zip(here, there, strict=True):
            assert (a[0].output_ids, a[0].logprobs) == (b[0].output_ids, b[0].logprobs), a[0].rid


def test_requests_generated_in_one_event_loop_turn_are_admitted_together(model_dir, fast_thread_switches):
    # the engine's own scheduler thread, woken by the first request, must not start on a part of them
    engine, _ = build_native_engine(str(model_dir), max_batch_size=16, seed=SEED)
    admitted: list[int] = []
    admit = engine._prefill

    def counting(groups):
        admitted.append(sum(len(g) for g in groups))
        return admit(groups)

    engine._prefill = counting
    prompts, params, rids = _prompts()
    reqs = [GenerateRequest(rid, p.input_ids, sp) for p, sp, rid in zip(prompts, params, rids, strict=True)]

    async def all_at_once():
        return await asyncio.gather(*(engine.generate(r) for r in reqs))

    try:
        for _ in range(3):
            admitted.clear()
            asyncio.run(all_at_once())
            assert admitted == [16], f"the scheduler admitted the batch in parts: {admitted}"
    finally:
        engine.stop()


def test_a_request_aborted_before_it_reaches_the_scheduler_finishes_at_once(model_dir):
    engine, _ = build_native_engine(str(model_dir), max_batch_size=4, background=False)
    prompts, params, rids = _prompts(1)

    async def abort_early():
        task = asyncio.ensure_future(engine.generate(GenerateRequest(rids[0], prompts[0].input_ids, params[0])))
        await asyncio.sleep(0)  # the request is staged, not yet queued for the scheduler
        assert engine.load == 1 and engine.abort(rids[0])
        return await task

    [c] = asyncio.run(abort_early())
    assert c.finish_reason["type"] == "abort" and c.output_ids == [] and engine.load == 0


def test_a_pool_call_is_split_in_contiguous_shares_one_per_engine_and_turns_that_fit_a_body():
    assert _shares(10, 3) == [(0, 4), (4, 7), (7, 10)]
    assert _shares(2, 4) == [(0, 1), (1, 2)]
    assert _shares(16, 1) == [(0, 16)]
    assert _shares(0, 2) == []
    assert _by_size([3, 3, 3, 3], 6) == [(0, 2), (2, 4)]
    assert _by_size([10, 1, 1], 5) == [(0, 1), (1, 3)]  # one over the limit goes alone (and is refused)
    assert _by_size([], 5) == []


def test_a_share_too_large_for_one_body_goes_in_turns_and_still_repeats(model_dir, fast_thread_switches):
    prompts, params, rids = _prompts()
    engine, _ = build_native_engine(str(model_dir), max_batch_size=16, seed=SEED)
    try:
        runs = served_runs(engine, model_dir, prompts, params, rids, max_request_bytes=5 * _request_bytes(prompts[-1]))
    finally:
        engine.stop()
    first = [(c[0].output_ids, c[0].logprobs) for c in runs[0]]
    assert all([(c[0].output_ids, c[0].logprobs) for c in run] == first for run in runs[1:])


def _rollouts(root: str, run_id: str) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    q = TransferQueue(root, run_id, "rollouts")
    q.refresh()
    ids = sorted(q.state.samples)
    rows = q.read(ids, ["tokens", "logprobs"])
    return {i: (t, lp) for i, t, lp in zip(ids, rows["tokens"], rows["logprobs"], strict=True)}


@pytest.mark.slow
def test_two_runs_with_an_engine_process_and_exact_staleness_repeat_bit_for_bit(tmp_path):
    root = f"file://{tmp_path}/root"
    weights, samples = [], []
    for run_id in ("first", "second"):
        cfg = tiny_config(root, run_id, "rollout.engine_processes=1", "queue.exact_staleness=true",
                          "trainer.total_steps=3")
        train(cfg, progress=False)
        weights.append(WeightStore(cfg.root, run_id).load()[0])
        samples.append(_rollouts(cfg.root, run_id))
    assert samples[0].keys() == samples[1].keys() and len(samples[0]) == 3 * 16
    for sid, (tokens, logprobs) in samples[0].items():
        assert np.array_equal(tokens, samples[1][sid][0]), f"sample {sid}: the sampled tokens differ"
        assert np.array_equal(logprobs, samples[1][sid][1]), f"sample {sid}: the logprobs differ"
    assert weights[0].keys() == weights[1].keys()
    assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0]), "the final weights differ"
