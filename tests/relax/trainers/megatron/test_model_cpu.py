"""megatron-core GPTModel built from tiny HF configs must compute what the HF model computes.

megatron keeps process-wide state (torch.distributed group, parallel_state, RNG tracker), so
every megatron run happens in a child process running this file as a script (the
``__main__`` block): a module-scoped fixture runs the single-process checks once, and the
tensor-parallel test starts two gloo ranks. The children write JSON, the tests assert on it.

Weights are re-drawn with unit-scale attention logits: with HF's default 0.02 init the
attention is nearly uniform and a mis-ordered q/k layout would hide inside atol. The
flat-QKV control shows the comparison does catch a wrong layout.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

# Any import failure (not installed, or a broken install) skips, with the reason in the -ra summary.
pytest.importorskip(
    "megatron.core",
    reason="megatron-core does not import; install it with: pip install --no-deps megatron-core==0.16.1",
    exc_type=ImportError,
)

HERE = Path(__file__).resolve()
REPO = HERE.parents[4]
ATOL = 1e-4
TINY = dict(
    num_hidden_layers=2,
    hidden_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=128,
    intermediate_size=96,
    rope_theta=1e6,
)
FAMILIES = {"qwen2": {}, "qwen3": {"head_dim": 32}, "llama": {"tie_word_embeddings": True}}


def tiny_hf(family: str, seed: int = 0) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config, Qwen3Config

    cls = {"qwen2": Qwen2Config, "qwen3": Qwen3Config, "llama": LlamaConfig}[family]
    config = cls(**TINY, **FAMILIES[family])
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).float().eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.copy_(1 + 0.2 * torch.randn_like(p))
            else:
                p.copy_(torch.randn_like(p) * 2.0 / p.shape[1] ** 0.5)
    return model


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


# ---------------------------------------------------------------- child-process workers


def worker_single() -> dict[str, Any]:
    """tp=1: logits vs HF for each family, a flat-QKV control, one training step."""
    from relax.trainers.megatron import convert
    from relax.trainers.megatron import cpu as mc
    from relax.trainers.megatron import model as mm

    mc.init_cpu_single_process()
    out: dict[str, Any] = {}
    ids = torch.randint(0, TINY["vocab_size"], (2, 16), generator=torch.Generator().manual_seed(1))
    for family in FAMILIES:
        hf = tiny_hf(family)
        cfg = convert.layout_from_hf_config(hf.config)
        gpt = mm.build_gpt_model(hf.config)
        mm.load_hf_weights(gpt, hf.state_dict(), cfg)
        with torch.no_grad():
            ref = hf(ids).logits
            diff = _max_diff(mm.forward_logits(gpt, ids), ref)
        back = mm.export_hf_weights(gpt, cfg)
        exact = back.keys() == hf.state_dict().keys() and all(
            torch.equal(back[k], v) for k, v in hf.state_dict().items()
        )
        out[family] = {"max_abs_diff": diff, "logit_scale": ref.abs().max().item(), "export_exact": exact}
        if family == "qwen2":  # control: the same weights with q, k, v simply concatenated
            flat = convert.hf_to_megatron(hf.state_dict(), cfg)
            for name in [n for n in flat if ".linear_qkv." in n]:
                flat[name] = torch.cat(convert.split_qkv(flat[name], cfg))
            gpt.load_state_dict(flat, strict=False)
            with torch.no_grad():
                out["flat_qkv_diff"] = _max_diff(mm.forward_logits(gpt, ids), ref)
    out["train"] = _train_step(mm, convert, ids)
    out["config"] = _config_mapping(mm)
    mc.shutdown_distributed()
    return out


def _train_step(mm: Any, convert: Any, ids: torch.Tensor) -> dict[str, Any]:
    """Loss and grads vs HF, then one AdamW step; exported weights reproduce megatron's logits.

    torch.optim is used because megatron's optimizer needs its CUDA-only DDP wrapper."""
    hf = tiny_hf("qwen2")
    cfg = convert.layout_from_hf_config(hf.config)
    gpt = mm.build_gpt_model(hf.config)
    mm.load_hf_weights(gpt, hf.state_dict(), cfg)
    labels = torch.roll(ids, -1, dims=1)
    b, s = ids.shape
    positions = torch.arange(s).unsqueeze(0).expand(b, -1)
    gpt.train()
    loss = gpt(ids, positions, mm.causal_attention_mask(s), labels=labels).mean()  # [b, s] -> mean
    loss.backward()
    hf_loss = torch.nn.functional.cross_entropy(hf(ids).logits.flatten(0, 1), labels.flatten())
    hf_loss.backward()
    grads = convert.megatron_to_hf({n: p.grad for n, p in gpt.named_parameters()}, cfg)
    grad_diff = max(_max_diff(grads[n], p.grad) for n, p in hf.named_parameters())
    before = mm.export_hf_weights(gpt, cfg)
    torch.optim.AdamW(gpt.parameters(), lr=1e-2).step()
    after = mm.export_hf_weights(gpt, cfg)
    changed = sum(not torch.equal(before[k], after[k]) for k in before)
    fresh = tiny_hf("qwen2", seed=7)
    fresh.load_state_dict(after, strict=True)
    gpt.eval()
    with torch.no_grad():
        post = mm.forward_logits(gpt, ids)
        post_diff = _max_diff(post, fresh(ids).logits)
        moved = _max_diff(post, hf(ids).logits)
    return {
        "loss": loss.item(),
        "hf_loss": hf_loss.item(),
        "grad_diff": grad_diff,
        "changed": changed,
        "tensors": len(before),
        "post_step_diff": post_diff,
        "logits_moved": moved,
    }


def _config_mapping(mm: Any) -> dict[str, Any]:
    """TransformerConfig fields whose megatron defaults would silently change the math, and RoPE."""
    from transformers import LlamaConfig

    tc = mm.transformer_config_from_hf(tiny_hf("qwen3").config)
    fields = (
        "add_bias_linear",
        "add_qkv_bias",
        "qk_layernorm",
        "gated_linear_unit",
        "normalization",
        "hidden_dropout",
        "attention_dropout",
        "kv_channels",
        "num_query_groups",
    )
    llama3 = LlamaConfig(
        **{**TINY, "max_position_embeddings": 16384, "rope_theta": 5e5},
        rope_scaling={
            "rope_type": "llama3",
            "factor": 32.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    )
    yarn = LlamaConfig(**TINY, rope_scaling={"rope_type": "yarn", "factor": 4.0})
    try:
        mm.rope_settings(yarn)
        yarn_error = ""
    except NotImplementedError as e:
        yarn_error = str(e)
    return {
        "qwen3": {f: getattr(tc, f) for f in fields},
        "activation": tc.activation_func.__name__,
        "llama3_rope": mm.rope_settings(llama3),
        "yarn_error": yarn_error,
    }


def worker_tp(rank: int, world: int, port: int) -> dict[str, Any]:
    """One rank of a tp=world gloo group: sharded load, forward, gathered export."""
    from relax.trainers.megatron import convert
    from relax.trainers.megatron import cpu as mc
    from relax.trainers.megatron import model as mm

    torch.set_num_threads(1)
    mc.init_cpu_distributed(rank, world, port, tp=world)
    out: dict[str, Any] = {}
    ids = torch.randint(0, TINY["vocab_size"], (2, 16), generator=torch.Generator().manual_seed(1))
    for family in ("qwen2", "qwen3"):
        hf = tiny_hf(family)
        cfg = convert.layout_from_hf_config(hf.config)
        gpt = mm.build_gpt_model(hf.config, tp=world)
        mm.load_hf_weights(gpt, hf.state_dict(), cfg)
        local_fc1 = gpt.decoder.layers[0].mlp.linear_fc1.weight
        expected_fc1 = convert.shard_for_tp(convert.hf_to_megatron(hf.state_dict(), cfg), cfg, world, rank)[
            "decoder.layers.0.mlp.linear_fc1.weight"
        ]
        with torch.no_grad():
            diff = _max_diff(mm.forward_logits(gpt, ids), hf(ids).logits)
        back = mm.export_hf_weights(gpt, cfg)
        out[family] = {
            "max_abs_diff": diff,
            "fc1_shard_ok": torch.equal(local_fc1, expected_fc1),
            "export_exact": all(torch.equal(back[k], v) for k, v in hf.state_dict().items()),
        }
    mc.shutdown_distributed()
    return out


def worker_gpu(ckpt_dir: str) -> dict[str, Any]:
    """CUDA, world size 1: megatron DDP + distributed optimizer step, dist_checkpointing
    save/load of the model, and HF export before/after (what the CPU run cannot reach)."""
    import torch.distributed as dist
    from megatron.core import dist_checkpointing, parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from relax.trainers.megatron import convert
    from relax.trainers.megatron import cpu as mc
    from relax.trainers.megatron import model as mm

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(mc.free_port()))
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", rank=0, world_size=1)
    parallel_state.initialize_model_parallel(1, 1)
    model_parallel_cuda_manual_seed(1234)
    hf = tiny_hf("qwen2").cuda()
    cfg = convert.layout_from_hf_config(hf.config)
    gpt = mm.build_gpt_model(hf.config)
    ddp = DistributedDataParallel(
        gpt.config, DistributedDataParallelConfig(use_distributed_optimizer=True), gpt
    )
    mm.load_hf_weights(ddp, hf.state_dict(), cfg)  # copies into DDP's contiguous param buffer
    opt = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=1e-2, use_distributed_optimizer=True), [ddp]
    )
    ids = torch.randint(0, TINY["vocab_size"], (2, 16), device="cuda")
    with torch.no_grad():
        diff = _max_diff(mm.forward_logits(ddp, ids), hf(ids).logits)
    b, s = ids.shape
    ddp.zero_grad_buffer()
    opt.zero_grad()
    positions = torch.arange(s, device="cuda").unsqueeze(0).expand(b, -1)
    loss = ddp(ids, positions, mm.causal_attention_mask(s, "cuda"), labels=torch.roll(ids, -1, 1)).mean()
    loss.backward()
    ddp.finish_grad_sync()
    ok, grad_norm, _ = opt.step()
    after = mm.export_hf_weights(ddp, cfg)
    changed = sum(not torch.equal(after[k], v) for k, v in hf.state_dict().items())
    dist_checkpointing.save(gpt.sharded_state_dict(), ckpt_dir)
    fresh = mm.build_gpt_model(hf.config)
    fresh.load_state_dict(dist_checkpointing.load(fresh.sharded_state_dict(), ckpt_dir), strict=False)
    reloaded = mm.export_hf_weights(fresh, cfg)
    mc.shutdown_distributed()
    return {
        "max_abs_diff": diff,
        "step_ok": bool(ok),
        "grad_norm": float(grad_norm),
        "changed": changed,
        "tensors": len(after),
        "reload_exact": all(torch.equal(reloaded[k], v) for k, v in after.items()),
    }


# ---------------------------------------------------------------- pytest side


def _child(*args: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    return subprocess.Popen(
        [sys.executable, str(HERE), *args],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def _result(proc: subprocess.Popen, out_file: Path, timeout: int = 300) -> dict[str, Any]:
    try:
        log, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        log, _ = proc.communicate()
    if proc.returncode != 0 or not out_file.exists():
        pytest.fail(f"megatron child process failed (rc={proc.returncode}):\n{log[-4000:]}")
    return json.loads(out_file.read_text())


@pytest.fixture(scope="module")
def single(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("mcore") / "single.json"
    return _result(_child("single", str(out)), out)


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_match_hf(single: dict[str, Any], family: str) -> None:
    res = single[family]
    print(f"{family}: max |logit diff| = {res['max_abs_diff']:.3g} (logits up to {res['logit_scale']:.3g})")
    assert res["logit_scale"] > 1.0  # the comparison is not between near-zero numbers
    assert res["max_abs_diff"] < ATOL
    assert res["export_exact"]


def test_flat_qkv_layout_is_detected(single: dict[str, Any]) -> None:
    assert single["flat_qkv_diff"] > 100 * ATOL


def test_training_step_matches_hf_and_exports(single: dict[str, Any]) -> None:
    t = single["train"]
    print(t)
    assert abs(t["loss"] - t["hf_loss"]) < 1e-5
    assert t["grad_diff"] < ATOL
    assert t["changed"] == t["tensors"]  # every tensor got a gradient and moved
    assert t["logits_moved"] > 1e-3
    assert t["post_step_diff"] < ATOL  # exported post-step weights reproduce megatron in HF


def test_config_mapping(single: dict[str, Any]) -> None:
    c = single["config"]
    assert c["qwen3"] == {
        "add_bias_linear": False,
        "add_qkv_bias": False,
        "qk_layernorm": True,
        "gated_linear_unit": True,
        "normalization": "RMSNorm",
        "hidden_dropout": 0.0,
        "attention_dropout": 0.0,
        "kv_channels": 32,
        "num_query_groups": 2,
    }
    assert c["activation"] == "silu"
    assert c["llama3_rope"] == {
        "position_embedding_type": "rope",
        "rotary_base": 500000,
        "rotary_percent": 1.0,
        "rope_scaling": True,
        "rope_scaling_factor": 32.0,
    }
    assert "'yarn' is not supported" in c["yarn_error"]


@pytest.mark.slow
def test_tp2_on_two_gloo_ranks(tmp_path: Path) -> None:
    with socket.socket() as sock:  # a free port, without importing megatron into this process
        sock.bind(("127.0.0.1", 0))
        port = str(sock.getsockname()[1])
    outs = [tmp_path / f"rank{r}.json" for r in range(2)]
    procs = [_child("tp", str(r), "2", port, str(outs[r])) for r in range(2)]
    results = [_result(p, o) for p, o in zip(procs, outs, strict=True)]
    for res in results:
        for family in ("qwen2", "qwen3"):
            assert res[family]["max_abs_diff"] < ATOL, (family, res[family])
            assert res[family]["fc1_shard_ok"] and res[family]["export_exact"], (family, res[family])


@pytest.mark.gpu
@pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU (megatron DDP and dist_checkpointing)"
)
def test_gpu_ddp_distributed_optimizer_and_dist_checkpoint(tmp_path: Path) -> None:
    out, ckpt = tmp_path / "gpu.json", tmp_path / "ckpt"
    ckpt.mkdir()
    res = _result(_child("gpu", str(ckpt), str(out)), out)
    assert res["max_abs_diff"] < ATOL
    assert res["step_ok"] and res["grad_norm"] > 0
    assert res["changed"] == res["tensors"]
    assert res["reload_exact"]


if __name__ == "__main__":
    import warnings

    warnings.filterwarnings("ignore")
    mode, *rest = sys.argv[1:]
    if mode == "single":
        result, path = worker_single(), rest[0]
    elif mode == "tp":
        result, path = worker_tp(int(rest[0]), int(rest[1]), int(rest[2])), rest[3]
    elif mode == "gpu":
        result, path = worker_gpu(rest[0]), rest[1]
    else:
        raise SystemExit(f"unknown mode {mode!r}")
    Path(path).write_text(json.dumps(result))
