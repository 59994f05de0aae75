"""Image and audio prompts through an HTTP engine: the rollout sends its expanded ``input_ids``
with the media bytes, and the engine answers exactly what an in-process engine answers.

Both engines hold the same tiny Omni weights and the same seed, so with the same per-request
sampling seed they must draw the same tokens with the same logprobs (float32, 1e-4)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from relax.config import load_config
from relax.data.suite import generate_suite
from relax.engines.client import EngineClient, EngineHTTPError
from relax.engines.server import build_native_engine, create_app
from relax.engines.types import SamplingParams
from relax.models import build_policy, build_tokenizer
from relax.rollout.engine_pool import LocalEngines
from relax.rollout.prompts import encode_prompt
from relax.rollout.remote_engines import RemoteEngines
from tests.relax.engines.contract import InProcessServer, data_uri

SEED = 7


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory):
    folder = Path(tmp_path_factory.mktemp("omni")) / "model"
    tok = build_tokenizer("bpe-tiny")
    model, processor = build_policy(load_config(None, ["model.name_or_path=tiny-omni"]).model, tok, seed=0)
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    engine, _ = build_native_engine(str(folder), max_batch_size=8, seed=SEED)
    engine.start()
    suite = generate_suite(["shapes", "tones"], seed=0, train_per_task=4, eval_per_task=2, difficulty=1)
    prompts = [encode_prompt(s, [r.data for r in s.images], [r.data for r in s.audios], tok, processor)
               for s in suite["train"]]
    local = LocalEngines(model, tok, max_batch_size=8, max_seq_len=256, seed=SEED)
    try:
        with InProcessServer(create_app(engine, str(folder), processor=processor)) as srv:
            remote = RemoteEngines([srv.url])
            try:
                yield srv.url, prompts, local, remote, processor.image_token_id
            finally:
                remote.close()
    finally:
        engine.stop()
        local.close()


def test_media_prompts_through_http_match_the_in_process_engine(setup):
    _, prompts, local, remote, _ = setup
    assert any(p.images for p in prompts) and any(p.audios for p in prompts)
    params = [SamplingParams(max_new_tokens=6, temperature=1.0, sampling_seed=100 + i) for i in range(len(prompts))]
    rids = [f"r{i}" for i in range(len(prompts))]
    here = local.generate(prompts, params, rids)
    there = remote.generate(prompts, params, rids)
    for a, b in zip(here, there, strict=True):
        assert a[0].output_ids == b[0].output_ids
        assert a[0].logprobs == pytest.approx(b[0].logprobs, abs=1e-4)
        assert b[0].prompt_tokens == a[0].prompt_tokens


def test_the_media_decides_the_answer_over_http(setup):
    # the same expanded ids with another image must change the logprobs: the engine used the bytes
    _, prompts, _, remote, _ = setup
    img = [p for p in prompts if p.images]
    assert len(img) >= 2 and img[0].images != img[1].images
    swapped = type(img[0])(img[0].input_ids, None, img[1].images, [])  # same-size pictures: same token run
    params = [SamplingParams(max_new_tokens=4, temperature=1.0, sampling_seed=5)] * 2
    a, b = remote.generate([img[0], swapped], params, ["x0", "x1"])
    assert a[0].logprobs != b[0].logprobs


def test_ids_that_do_not_fit_the_media_are_a_400_naming_the_counts(setup):
    url, prompts, _, _, image_id = setup
    p = next(p for p in prompts if p.images)
    short = list(p.input_ids)
    short.remove(image_id)

    async def ask() -> None:
        async with EngineClient(url, retries=0) as c:
            await c.generate(input_ids=short, image_data=[data_uri(p.images[0])], sampling_params={"max_new_tokens": 2})

    with pytest.raises(EngineHTTPError) as err:
        asyncio.run(ask())
    assert err.value.status == 400 and "image token(s)" in str(err.value) and "expand to" in str(err.value)
