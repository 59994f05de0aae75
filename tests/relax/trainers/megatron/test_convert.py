"""HF <-> megatron layout conversion, checked on tiny HF models built from config (no megatron,
no downloads). Round trips must be bit-exact: conversion only moves numbers around."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config, Qwen3Config

from relax.trainers.megatron.convert import (
    ConversionError,
    LayoutConfig,
    gather_tp,
    hf_to_megatron,
    layout_from_hf_config,
    mcore_shapes,
    megatron_to_hf,
    merge_qkv,
    shard_for_tp,
    split_qkv,
    stage_merge,
    stage_slice,
)

FAMILIES = {"qwen2": Qwen2Config, "qwen3": Qwen3Config, "llama": LlamaConfig}
TINY = dict(
    num_hidden_layers=2,
    hidden_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=128,
    intermediate_size=96,
)


def tiny_config(family: str, **overrides):
    extra = {"head_dim": 32} if family == "qwen3" else {}  # head_dim != H/h, as in real Qwen3
    return FAMILIES[family](**{**TINY, **extra, **overrides})


def tiny_model(family: str, seed: int = 0, **overrides) -> torch.nn.Module:
    """A float32 model whose every tensor holds distinct random values (norms and biases too,
    which HF initialises to ones/zeros and which would hide a swapped tensor)."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(family, **overrides)).float().eval()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p))
    return model


@pytest.mark.parametrize("family", FAMILIES)
def test_round_trip_is_exact(family):
    model = tiny_model(family)
    cfg = layout_from_hf_config(model.config)
    hf = model.state_dict()
    mcore = hf_to_megatron(hf, cfg)
    assert {k: tuple(v.shape) for k, v in mcore.items()} == mcore_shapes(cfg)
    back = megatron_to_hf(mcore, cfg)
    assert back.keys() == hf.keys()
    for name in hf:
        assert torch.equal(back[name], hf[name]), name
    # and the exported dict is loadable by a fresh HF model, strictly
    fresh = AutoModelForCausalLM.from_config(model.config).float().eval()
    fresh.load_state_dict(back, strict=True)
    ids = torch.randint(0, 128, (1, 8))
    with torch.no_grad():
        assert torch.equal(fresh(ids).logits, model(ids).logits)


def test_layout_from_hf_config():
    assert layout_from_hf_config(tiny_config("qwen2")) == LayoutConfig(
        num_layers=2,
        hidden_size=64,
        num_attention_heads=4,
        num_query_groups=2,
        kv_channels=16,
        ffn_hidden_size=96,
        vocab_size=128,
        qkv_bias=True,
        qk_layernorm=False,
        tie_word_embeddings=False,
    )
    q3 = layout_from_hf_config(tiny_config("qwen3"))
    assert (q3.kv_channels, q3.qkv_bias, q3.qk_layernorm) == (32, False, True)
    llama = layout_from_hf_config(tiny_config("llama", tie_word_embeddings=True))
    assert (llama.qkv_bias, llama.qk_layernorm, llama.tie_word_embeddings) == (False, False, True)
    with pytest.raises(ValueError, match="unsupported model_type 'gpt2'"):
        layout_from_hf_config(type("C", (), {"model_type": "gpt2"})())


def test_qkv_interleaving_hand_checked():
    # h=4 query heads, g=2 groups (r=2 heads per group), d=2 rows per head, H=3 columns.
    # Label each HF row by its first entry: q head i has rows 2i, 2i+1 -> labels 0..7;
    # k head j has rows 100+2j, 100+2j+1; v head j has rows 200+2j, 200+2j+1.
    # Group 0 = query heads 0,1 with k0, v0; group 1 = query heads 2,3 with k1, v1, so the
    # megatron rows are: [q0 q0 q1 q1 k0 k0 v0 v0 | q2 q2 q3 q3 k1 k1 v1 v1]
    #                  = [0 1 2 3 100 101 200 201 | 4 5 6 7 102 103 202 203].
    cfg = LayoutConfig(
        num_layers=1,
        hidden_size=3,
        num_attention_heads=4,
        num_query_groups=2,
        kv_channels=2,
        ffn_hidden_size=4,
        vocab_size=8,
    )
    labels_q, labels_k, labels_v = torch.arange(8.0), 100 + torch.arange(4.0), 200 + torch.arange(4.0)
    q, k, v = (lab[:, None].repeat(1, 3) for lab in (labels_q, labels_k, labels_v))
    expected = [0, 1, 2, 3, 100, 101, 200, 201, 4, 5, 6, 7, 102, 103, 202, 203]
    fused = merge_qkv(q, k, v, cfg)
    assert fused.shape == (16, 3)
    assert fused[:, 0].tolist() == expected and torch.equal(fused[:, 0], fused[:, 2])
    assert merge_qkv(labels_q, labels_k, labels_v, cfg).tolist() == expected  # biases
    for got, want in zip(split_qkv(fused, cfg), (q, k, v), strict=True):
        assert torch.equal(got, want)
    # a flat cat is a different order, even though it has the same shape
    assert torch.cat([labels_q, labels_k, labels_v]).tolist() != expected


def test_fc1_is_gate_then_up():
    model = tiny_model("llama")
    hf = model.state_dict()
    fc1 = hf_to_megatron(hf, layout_from_hf_config(model.config))["decoder.layers.1.mlp.linear_fc1.weight"]
    assert torch.equal(fc1[:96], hf["model.layers.1.mlp.gate_proj.weight"])
    assert torch.equal(fc1[96:], hf["model.layers.1.mlp.up_proj.weight"])


@pytest.mark.parametrize("family", FAMILIES)
def test_tp2_shard_gather_round_trip(family):
    model = tiny_model(family)
    cfg = layout_from_hf_config(model.config)
    hf = model.state_dict()
    mcore = hf_to_megatron(hf, cfg)
    shards = [shard_for_tp(mcore, cfg, 2, rank) for rank in range(2)]
    gathered = gather_tp(shards, cfg)
    assert gathered.keys() == mcore.keys()
    for name in mcore:
        assert torch.equal(gathered[name], mcore[name]), name

    p = "decoder.layers.0."
    F, qkv_rows = cfg.ffn_hidden_size, (4 + 2 * 2) * cfg.kv_channels
    # fc1 on rank 1 = second half of gate, then second half of up (not rows 96..191 of fc1)
    gate, up = hf["model.layers.0.mlp.gate_proj.weight"], hf["model.layers.0.mlp.up_proj.weight"]
    assert torch.equal(shards[1][p + "mlp.linear_fc1.weight"], torch.cat([gate[F // 2 :], up[F // 2 :]]))
    # qkv: a contiguous half = one whole query group (g=2, tp=2)
    assert torch.equal(
        shards[1][p + "self_attention.linear_qkv.weight"],
        mcore[p + "self_attention.linear_qkv.weight"][qkv_rows // 2 :],
    )
    assert shards[0][p + "self_attention.linear_proj.weight"].shape == (64, 4 * cfg.kv_channels // 2)
    assert shards[0][p + "mlp.linear_fc2.weight"].shape == (64, F // 2)
    assert shards[1]["embedding.word_embeddings.weight"].shape == (64, 64)
    assert torch.equal(shards[1][p + "input_layernorm.weight"], mcore[p + "input_layernorm.weight"])
    # and the gathered state converts back to the original HF tensors
    back = megatron_to_hf(gathered, cfg)
    assert all(torch.equal(back[k], hf[k]) for k in hf)


def test_tp_requires_divisible_vocab():
    model = tiny_model("qwen2", vocab_size=127)
    cfg = layout_from_hf_config(model.config)
    mcore = hf_to_megatron(model.state_dict(), cfg)
    with pytest.raises(ValueError, match=r"vocab_size=127 is not divisible by tp=2.*pad"):
        shard_for_tp(mcore, cfg, 2, 0)
    good = tiny_model("qwen2")
    good_cfg = layout_from_hf_config(good.config)
    with pytest.raises(ValueError, match="rank=2 is out of range for tp=2"):
        shard_for_tp(hf_to_megatron(good.state_dict(), good_cfg), good_cfg, 2, 2)


def test_tied_embeddings():
    model = tiny_model("llama", tie_word_embeddings=True)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    cfg = layout_from_hf_config(model.config)
    hf = model.state_dict()
    mcore = hf_to_megatron(hf, cfg)
    assert "output_layer.weight" not in mcore  # megatron computes logits from the embedding
    mcore_without_lm_head = hf_to_megatron({k: v for k, v in hf.items() if k != "lm_head.weight"}, cfg)
    assert mcore_without_lm_head.keys() == mcore.keys()
    back = megatron_to_hf(mcore, cfg)
    assert torch.equal(back["lm_head.weight"], hf["model.embed_tokens.weight"])
    fresh = AutoModelForCausalLM.from_config(model.config).float()
    fresh.load_state_dict(back, strict=True)
    assert fresh.lm_head.weight is fresh.model.embed_tokens.weight
    # tied shards round-trip too
    assert gather_tp([shard_for_tp(mcore, cfg, 2, r) for r in range(2)], cfg).keys() == mcore.keys()


@pytest.mark.parametrize("tied", [False, True])
def test_pipeline_stages_slice_and_merge_exactly(tied):
    model = tiny_model("qwen2", num_hidden_layers=4, tie_word_embeddings=tied)
    cfg = layout_from_hf_config(model.config)
    mcore = hf_to_megatron(model.state_dict(), cfg)
    first = stage_slice(mcore, cfg, 0, 2, first=True, last=False)
    last = stage_slice(mcore, cfg, 2, 2, first=False, last=True)
    layer = {k.split(".", 3)[3] for k in mcore if k.startswith("decoder.layers.0.")}
    assert set(first) == {"embedding.word_embeddings.weight"} | {
        f"decoder.layers.{i}.{n}" for i in (0, 1) for n in layer
    }
    assert set(last) == {"decoder.final_layernorm.weight", "output_layer.weight"} | {
        f"decoder.layers.{i}.{n}" for i in (0, 1) for n in layer}
    # the last stage's layer 0 is global layer 2; a tied model's output layer is the embedding (megatron's copy)
    assert torch.equal(last["decoder.layers.0.mlp.linear_fc1.weight"], mcore["decoder.layers.2.mlp.linear_fc1.weight"])
    out = "embedding.word_embeddings.weight" if tied else "output_layer.weight"
    assert torch.equal(last["output_layer.weight"], mcore[out])
    merged = stage_merge([(0, first), (2, last)], cfg)
    assert merged.keys() == mcore.keys() and all(torch.equal(merged[k], mcore[k]) for k in mcore)
    with pytest.raises(ConversionError, match="'decoder.layers.2.input_layernorm.weight' is held by two"):
        stage_merge([(0, first), (2, last), (2, last)], cfg)


def test_export_accepts_wrapper_prefixes_extra_state_and_te_names():
    model = tiny_model("qwen3")
    cfg = layout_from_hf_config(model.config)
    hf = model.state_dict()
    wrapped: dict = {}
    for name, t in hf_to_megatron(hf, cfg).items():
        name = name.replace(".input_layernorm.weight", ".self_attention.linear_qkv.layer_norm_weight")
        wrapped["module.module." + name] = t
        if name.endswith("linear_qkv.weight"):
            wrapped["module.module." + name.replace(".weight", "._extra_state")] = None
    back = megatron_to_hf(wrapped, cfg)
    assert all(torch.equal(back[k], hf[k]) for k in hf)


def test_errors_name_the_tensor_and_both_shapes():
    model = tiny_model("qwen2")
    cfg = layout_from_hf_config(model.config)
    hf = dict(model.state_dict())
    del hf["model.layers.1.self_attn.k_proj.bias"]
    hf["model.layers.0.mlp.up_proj.weight"] = torch.zeros(95, 64)
    hf["model.layers.0.self_attn.rotary.extra"] = torch.zeros(3)
    with pytest.raises(ConversionError) as err:
        hf_to_megatron(hf, cfg)
    msg = str(err.value)
    assert "missing tensor 'model.layers.1.self_attn.k_proj.bias' (expected shape [32])" in msg
    assert "tensor 'model.layers.0.mlp.up_proj.weight' has shape [95, 64], expected [96, 64]" in msg
    assert "unexpected tensor 'model.layers.0.self_attn.rotary.extra' (shape [3])" in msg

    mcore = hf_to_megatron(model.state_dict(), cfg)
    mcore["decoder.layers.0.self_attention.linear_qkv.weight"] = torch.zeros(64, 64)
    with pytest.raises(
        ConversionError, match=r"linear_qkv.weight' has shape \[64, 64\], expected \[128, 64\]"
    ):
        megatron_to_hf(mcore, cfg)
    # a Qwen3 checkpoint read with a Qwen2 layout fails on names, not silently
    with pytest.raises(ConversionError, match="unexpected tensor 'model.layers.0.self_attn.q_norm.weight'"):
        hf_to_megatron(tiny_model("qwen3", head_dim=16).state_dict(), cfg)


def test_parallel_sizes_come_from_the_trainer_config():
    import importlib.util

    if importlib.util.find_spec("megatron") is None:
        pytest.skip("megatron-core is not installed")
    from relax.config import TrainerConfig
    from relax.trainers.megatron.model import parallel_sizes

    # the dataclass itself: the config loader refuses these layouts in the RL loop until they are wired
    t = TrainerConfig(backend="megatron", tensor_parallel=2, pipeline_parallel=4, context_parallel=1, expert_parallel=8)
    assert parallel_sizes(t) == {"tp": 2, "pp": 4, "cp": 1, "ep": 8}


def test_expert_parallel_slices_blocks_of_experts_and_merges_them_back():
    from types import SimpleNamespace

    from relax.trainers.megatron.mlp import expert_merge, expert_slice, local_expert

    cfg = SimpleNamespace(num_experts=4)
    e = "decoder.layers.1.mlp.experts.local_experts."
    full = {"decoder.layers.1.mlp.router.weight": torch.zeros(4, 2),
            **{f"{e}{i}.linear_fc1.weight": torch.full((2, 2), float(i)) for i in range(4)}}
    # EP rank 1 of 2 holds global experts 2 and 3 as its local 0 and 1; the router stays whole
    part = expert_slice(full, cfg, 2, 1)
    assert sorted(part) == ["decoder.layers.1.mlp.experts.local_experts.0.linear_fc1.weight",
                            "decoder.layers.1.mlp.experts.local_experts.1.linear_fc1.weight",
                            "decoder.layers.1.mlp.router.weight"]
    assert part[f"{e}0.linear_fc1.weight"][0, 0] == 2 and part[f"{e}1.linear_fc1.weight"][0, 0] == 3
    merged = expert_merge([expert_slice(full, cfg, 2, r) for r in range(2)], cfg)
    assert merged.keys() == full.keys() and all(torch.equal(merged[k], full[k]) for k in full)
    assert local_expert(f"{e}3.linear_fc2.weight") == 3 and local_expert("decoder.layers.1.mlp.router.weight") is None
    assert expert_slice(full, cfg, 1, 0) is full  # ep = 1: nothing to split
    with pytest.raises(ValueError, match="expert_parallel=3 does not divide the model's 4 experts"):
        expert_slice(full, cfg, 3, 0)
