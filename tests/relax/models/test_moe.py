"""Mixture-of-experts policies (``model.family=qwen2_moe`` / ``qwen3_moe`` on the built-in
``tiny-qwen2``): Hugging Face's own classes with top-2 routing over 4 experts (Qwen2-MoE also
with its gated shared expert), served by the native engine with the log-probs of an HF forward
and trained by the PyTorch trainer, router included."""

from __future__ import annotations

import pytest
import torch

from relax.config import ConfigError, ModelConfig, load_config
from relax.engines.native.engine import NativeEngine
from relax.engines.native.fused_decode import FusedDecoder
from relax.engines.types import GenerateRequest, SamplingParams
from relax.models import build_policy, build_tokenizer

FAMILIES = ("qwen2_moe", "qwen3_moe")


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer("bpe-tiny")


def _moe(tok, family: str):
    return build_policy(ModelConfig(name_or_path="tiny-qwen2", family=family), tok, seed=0)[0]


@pytest.mark.parametrize("family", FAMILIES)
def test_the_builtin_is_a_routed_mixture_of_experts(tok, family):
    model = _moe(tok, family)
    assert model.config.model_type == family
    assert (model.config.num_experts, model.config.num_experts_per_tok) == (4, 2)
    layer = model.model.layers[0].mlp
    assert type(layer).__name__.endswith("SparseMoeBlock")
    assert hasattr(layer, "shared_expert") == (family == "qwen2_moe")
    assert FusedDecoder.maybe(model) is None  # the engine runs the HF layers (their routing) itself


@pytest.mark.parametrize("family", FAMILIES)
def test_the_native_engine_samples_with_the_hf_forwards_logprobs(tok, family):
    model = _moe(tok, family)
    engine = NativeEngine(model, tok, max_batch_size=4, max_seq_len=64, seed=0, background=False)
    prompts = [tok(text, add_special_tokens=False)["input_ids"] for text in ("What is 3 + 4?", "Name a colour.",
                                                                            "2 * 5 =")]
    futures = [engine.submit(GenerateRequest(f"r{i}", p, SamplingParams(max_new_tokens=6)))
               for i, p in enumerate(prompts)]  # one batch: the routing of each row must not see the others
    while engine.step():
        pass
    checked = 0
    for p, future in zip(prompts, futures, strict=True):
        c = future.result()[0]
        with torch.no_grad():
            logp = torch.log_softmax(model(input_ids=torch.tensor([p + c.output_ids])).logits[0].float(), -1)
        expected = [float(logp[len(p) - 1 + i, t]) for i, t in enumerate(c.output_ids)]
        assert c.logprobs == pytest.approx(expected, abs=1e-4)
        checked += len(expected)
    assert checked >= 12


@pytest.mark.parametrize("family", FAMILIES)
def test_one_training_step_moves_the_router_and_the_experts(tok, family):
    from relax.trainers.torch.actor import Actor
    from relax.trainers.torch.batch import RolloutBatch

    cfg = load_config(None, ["trainer.warmup_steps=0", "trainer.lr=1e-2", "algorithm.off_policy=none",
                             f"model.family={family}"])
    model = _moe(tok, family)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    g = torch.Generator().manual_seed(0)
    ids = [torch.randint(3, len(tok), (12,), generator=g) for _ in range(4)]
    masks = [torch.cat([torch.zeros(4), torch.ones(8)]) for _ in ids]
    with torch.no_grad():
        old = Actor(model, cfg).logprobs(RolloutBatch(ids=[str(i) for i in range(4)], input_ids=ids, loss_mask=masks))
    batch = RolloutBatch(ids=[str(i) for i in range(4)], input_ids=ids, loss_mask=masks,
                         old_logprobs=[lp * m for lp, m in zip(old, masks, strict=True)],
                         advantages=[m * (1.0 if i % 2 else -1.0) for i, m in enumerate(masks)],
                         rewards=torch.tensor([0.0, 1.0, 0.0, 1.0]), policy_versions=[0] * 4)
    result = Actor(model, cfg).train_step(batch)
    assert result.grad_norm > 0 and not result.skipped
    after = model.state_dict()
    for layer in range(model.config.num_hidden_layers):
        gate, experts = f"model.layers.{layer}.mlp.gate.weight", f"model.layers.{layer}.mlp.experts.gate_up_proj"
        # the router learns (through the routing weights of the experts it kept), and more than one expert trains
        assert not torch.equal(after[gate], before[gate])
        moved = [e for e in range(model.config.num_experts) if not torch.equal(after[experts][e], before[experts][e])]
        assert len(moved) >= 2, (layer, moved)


def test_moe_families_build_on_both_backends_and_are_refused_where_they_cannot():
    assert load_config(None, ["model.family=qwen2_moe", "trainer.backend=megatron"]).trainer.backend == "megatron"
    with pytest.raises(
        ConfigError, match="model.family='qwen3_moe' cannot be built from model.name_or_path='tiny-omni'"
    ):
        load_config(None, ["model.family=qwen3_moe", "model.name_or_path=tiny-omni"])
