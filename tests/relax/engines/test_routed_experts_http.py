"""SGLang's routed-experts wire form on the native engine server: ``--enable-return-routed-experts``
records them, ``return_routed_experts`` returns them base64 int32 in ``meta_info``, and the rollout's
HTTP pool decodes them to the ids the engine used."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch

from relax.config import ModelConfig
from relax.engines.client import EngineClient, EngineHTTPError
from relax.engines.native.engine import NativeEngine
from relax.engines.server import create_app
from relax.engines.types import EngineError, SamplingParams, routes_from_wire, routes_to_wire
from relax.models import build_policy, build_tokenizer
from relax.models.moe_routing import RouteRecorder, route_shape
from relax.rollout.prompts import EncodedPrompt
from relax.rollout.remote_engines import RemoteEngines
from relax.services.queue_contract import routes_column
from tests.relax.engines.contract import InProcessServer


@pytest.fixture(scope="module")
def moe():
    tok = build_tokenizer("bpe-tiny")
    return build_policy(ModelConfig(name_or_path="tiny-qwen2", family="qwen2_moe"), tok, seed=0)[0], tok


def test_the_wire_form_round_trips_and_garbage_is_refused_naming_the_request():
    routes = np.array([[[0, 3], [2, 1]]], dtype=np.int16)  # 1 position, 2 layers, top-2
    flat = routes_from_wire(routes_to_wire(routes), "r1")
    assert flat.dtype == np.int32 and flat.tolist() == [0, 3, 2, 1]
    assert routes_column(flat, 2, "s", (2, 2)).tolist() == [[[0, 3], [2, 1]], [[-1, -1], [-1, -1]]]
    with pytest.raises(EngineError, match="unreadable routed_experts for request r9"):
        routes_from_wire("not base64!", "r9")
    with pytest.raises(ValueError, match="5 routed expert ids do not fill whole positions"):
        routes_column(np.arange(5, dtype=np.int32), 3, "s", (2, 2))


def test_an_http_pool_gets_the_experts_the_engine_used(moe):
    model, tok = moe
    engine = NativeEngine(model, tok, max_batch_size=8, max_seq_len=64, seed=0, record_routes=True)
    prompt = tok("What is 3 + 4?", add_special_tokens=False)["input_ids"]
    with InProcessServer(create_app(engine, "tiny-moe")) as server:
        pool = RemoteEngines([server.url], routed_experts=True)
        try:
            (c,), = pool.generate([EncodedPrompt(prompt, None, [], [])], [SamplingParams(max_new_tokens=6)], ["r0"])
        finally:
            pool.close()
    routes = routes_column(c.routed_experts, len(prompt) + len(c.output_ids), "r0", route_shape(model))
    recorder = RouteRecorder(model)
    with torch.no_grad(), recorder.capture() as own:
        model(input_ids=torch.tensor([prompt + c.output_ids[:-1]]))
    assert np.array_equal(routes[:-1], own[0].numpy()) and (routes[-1] == -1).all()


def test_a_server_that_records_nothing_says_which_flag_to_start_it_with(moe):
    model, tok = moe
    engine = NativeEngine(model, tok, max_batch_size=2, max_seq_len=64, seed=0)

    async def ask(**extra):
        async with EngineClient(server.url, retries=0) as client:
            with pytest.raises(EngineHTTPError) as e:
                await client.generate(input_ids=[1, 2, 3], sampling_params={"max_new_tokens": 2}, **extra)
            return e.value

    with InProcessServer(create_app(engine, "tiny-moe")) as server:
        refused = asyncio.run(ask(return_routed_experts=True))
        assert refused.status == 400 and "--enable-return-routed-experts" in refused.message
        assert "routed_experts_start_len" in asyncio.run(ask(routed_experts_start_len=2)).message
