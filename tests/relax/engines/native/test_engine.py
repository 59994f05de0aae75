"""NativeEngine: exact logprobs, deterministic continuous batching, stops, abort, hot reload."""

from __future__ import annotations

import concurrent.futures

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from relax.engines.native.engine import NativeEngine
from relax.engines.types import EngineError, GenerateRequest, SamplingParams


def tiny(seed: int = 0) -> Qwen2ForCausalLM:
    torch.manual_seed(seed)
    cfg = Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=128)
    return Qwen2ForCausalLM(cfg).eval()


@pytest.fixture
def engine():
    eng = NativeEngine(tiny(), None, max_batch_size=8).start()
    yield eng
    eng.stop()


def req(rid: str, prompt_len: int = 4, **params) -> GenerateRequest:
    return GenerateRequest(rid, list(range(1, prompt_len + 1)), SamplingParams(**params))


def test_logprobs_equal_a_forward_pass(engine):
    futures = [engine.submit(req(f"r{i}", 3 + i, max_new_tokens=5 + i, n=2, temperature=1.0)) for i in range(6)]
    for f in futures:
        for c in f.result(timeout=60):
            prompt = list(range(1, c.prompt_tokens + 1))
            with torch.no_grad():
                logits = engine.model(torch.tensor([prompt + c.output_ids])).logits[0].float()
            ref = torch.log_softmax(logits, -1)[c.prompt_tokens - 1:-1].gather(-1, torch.tensor(c.output_ids)[:, None])
            assert torch.allclose(torch.tensor(c.logprobs), ref.squeeze(-1), atol=1e-4)
            assert c.weight_version == "0" and c.finish_reason == {"type": "length", "length": len(c.output_ids)}


def test_same_seed_same_tokens_alone_or_in_a_crowd(engine):
    alone = engine.submit(req("x", 5, max_new_tokens=8, n=3, sampling_seed=7)).result(60)
    crowd = [engine.submit(req(f"c{i}", 2 + i, max_new_tokens=10)) for i in range(6)]
    again = engine.submit(req("x", 5, max_new_tokens=8, n=3, sampling_seed=7))  # joins a running batch
    concurrent.futures.wait(crowd)
    assert [c.output_ids for c in again.result(60)] == [c.output_ids for c in alone]
    assert len({tuple(c.output_ids) for c in alone}) > 1  # the n samples differ from each other


def test_temperature_zero_is_greedy(engine):
    (c,) = engine.submit(req("g", 4, max_new_tokens=6, temperature=0.0)).result(60)
    ids = list(range(1, 5))
    for _ in range(6):
        with torch.no_grad():
            ids.append(int(engine.model(torch.tensor([ids])).logits[0, -1].argmax()))
    assert c.output_ids == ids[4:]


def test_stop_ids_and_zero_tokens(engine):
    (first,) = engine.submit(req("a", 4, max_new_tokens=6, temperature=0.0)).result(60)
    stop = first.output_ids[2]
    (c,) = engine.submit(req("b", 4, max_new_tokens=6, temperature=0.0, stop_token_ids=[stop])).result(60)
    assert c.output_ids == first.output_ids[: first.output_ids.index(stop) + 1]
    assert c.finish_reason == {"type": "stop", "matched": stop}
    (z,) = engine.submit(req("z", 4, max_new_tokens=0)).result(60)
    assert z.output_ids == [] and z.finish_reason["type"] == "length"


def test_abort_and_bad_requests(engine):
    long = engine.submit(req("long", 4, max_new_tokens=120, ignore_eos=True))
    assert engine.abort("long")
    (c,) = long.result(60)
    assert c.finish_reason["type"] == "abort" and len(c.output_ids) < 120
    assert not engine.abort("unknown")
    with pytest.raises(EngineError, match="prompt has 200 tokens but the context length is 128"):
        engine.submit(req("big", 200))
    with pytest.raises(EngineError, match="top_p must be in"):
        engine.submit(req("p", 4, top_p=0.0))


def test_hot_reload_changes_outputs_to_the_new_weights(engine):
    (before,) = engine.submit(req("h", 4, max_new_tokens=6, temperature=0.0)).result(60)
    other = tiny(seed=1)
    engine.update_weights(other.state_dict(), "1")
    (after,) = engine.submit(req("h", 4, max_new_tokens=6, temperature=0.0)).result(60)
    fresh = NativeEngine(tiny(seed=1), None, max_batch_size=2).start()
    try:
        (expected,) = fresh.submit(req("h", 4, max_new_tokens=6, temperature=0.0)).result(60)
    finally:
        fresh.stop()
    assert after.output_ids == expected.output_ids != before.output_ids
    assert (before.weight_version, after.weight_version) == ("0", "1")
    bad = {k: v[:1] for k, v in other.state_dict().items()}
    with pytest.raises(EngineError, match="do not fit this model"):
        engine.update_weights(bad, "2")
    assert engine.weight_version == "1"


@pytest.mark.parametrize("family", ["qwen2", "qwen3", "llama"])
def test_fused_decode_matches_the_hf_forward(family):
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(3)
    common = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=128)
    model = {"qwen2": lambda: Qwen2ForCausalLM(Qwen2Config(**common)),
             "qwen3": lambda: Qwen3ForCausalLM(Qwen3Config(head_dim=8, **common)),
             "llama": lambda: LlamaForCausalLM(LlamaConfig(**common))}[family]().eval()
    for p in model.parameters():  # unit-scale weights: a wrong rope or norm would show at 1e-4
        torch.nn.init.normal_(p, std=0.5)
    engine = NativeEngine(model, None, max_batch_size=4, background=False)
    assert engine.fused is not None  # the lean path is the one under test
    futures = [engine.submit(req(f"f{i}", 3 + 2 * i, max_new_tokens=6, n=2)) for i in range(3)]
    engine.run_until_idle()
    for f in futures:
        for c in f.result():
            prompt = list(range(1, c.prompt_tokens + 1))
            with torch.no_grad():
                logits = model(torch.tensor([prompt + c.output_ids])).logits[0].float()
            ref = torch.log_softmax(logits, -1)[c.prompt_tokens - 1:-1].gather(-1, torch.tensor(c.output_ids)[:, None])
            assert torch.allclose(torch.tensor(c.logprobs), ref.squeeze(-1), atol=1e-4), family



@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_logprobs_on_cuda_equal_a_forward_pass(dtype):
    # float32 without TF32 matches the forward as on a CPU; bf16 only within its rounding (~1e-2 on logprobs)
    torch.backends.cuda.matmul.allow_tf32 = False
    model = tiny().to("cuda", dtype)
    engine = NativeEngine(model, None, max_batch_size=8, background=False)
    futures = [engine.submit(req(f"c{i}", 3 + i, max_new_tokens=6, n=2, temperature=1.0)) for i in range(4)]
    engine.run_until_idle()
    for f in futures:
        for c in f.result():
            prompt = torch.tensor([list(range(1, c.prompt_tokens + 1)) + c.output_ids], device="cuda")
            with torch.no_grad():
                logits = model(prompt).logits[0].float()
            ref = torch.log_softmax(logits, -1)[c.prompt_tokens - 1:-1].gather(
                -1, torch.tensor(c.output_ids, device="cuda")[:, None]).squeeze(-1).cpu()
            assert torch.allclose(torch.tensor(c.logprobs), ref, atol=1e-4 if dtype == torch.float32 else 5e-2)
