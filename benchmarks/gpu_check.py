"""The device check for a lent GPU, as one script: the ``gpu``-marked tests, then a 0.5B-shaped Qwen2's
actor step and native-engine decode, each timed beside its alternative in the same run.

* tests: ``pytest -m gpu`` over the files holding them (CUDA bf16 trainer step, native engine logprobs
  on CUDA, megatron DDP + distributed optimizer + dist_checkpointing, the megatron actor step on CUDA),
  in a child process; passed / failed / skipped counts and the failures' names;
* actor step: one GRPO-shaped update (16 samples of 512 tokens, packed micro-batches of 4096 tokens)
  with bf16 autocast and in float32 (master weights and AdamW in float32 both ways): seconds, tokens/s,
  peak memory, and the bf16 / float32 speed ratio;
* Megatron backend (where megatron-core imports): the same bf16 step on megatron-core's GPTModel with
  AdamW and with megatron's DistributedOptimizer (``trainer.distributed_optimizer``), beside the PyTorch
  backend's bf16 step;
* decode: 32 prompts x 128 new tokens (EOS ignored) from the native engine and from Hugging Face
  ``generate()`` on the same model: tokens/s and the ratio.

    python benchmarks/gpu_check.py [--tiny] [--skip-tests] [--update-docs]

The model is random (Qwen2.5-0.5B's shape from a config; nothing is downloaded). ``--tiny`` runs a
2-layer model on whatever device there is (how the script itself is tested on a CPU). Writes
gpu_check.json (output.py decides where) and prints it as one JSON line.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

import torch
from output import Output, add_arguments
from transformers import Qwen2Config, Qwen2ForCausalLM

from relax.config import load_config
from relax.engines.native.engine import NativeEngine
from relax.engines.types import GenerateRequest, SamplingParams
from relax.trainers.torch.actor import Actor
from relax.trainers.torch.batch import RolloutBatch

REPO = Path(__file__).resolve().parents[1]
GPU_TESTS = ["tests/relax/trainers/torch/test_trainer.py", "tests/relax/engines/native/test_engine.py",
             "tests/relax/trainers/megatron/test_model_cpu.py", "tests/relax/trainers/megatron/test_actor_cuda.py"]
QWEN25_05B = dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                  num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=4096, rope_theta=1e6,
                  tie_word_embeddings=True)
TINY = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=1024, tie_word_embeddings=True)


def run_gpu_tests() -> dict:
    """``pytest -m gpu`` over GPU_TESTS in a child process: counts and the failing tests' names."""
    with tempfile.TemporaryDirectory() as tmp:
        xml = Path(tmp) / "junit.xml"
        proc = subprocess.run([sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider",
                               f"--junitxml={xml}", *GPU_TESTS], cwd=REPO, capture_output=True, text=True,
                              timeout=420)
        if not xml.exists():
            return {"error": (proc.stdout + proc.stderr)[-2000:]}
        cases = ET.parse(xml).getroot().iter("testcase")
        out: dict = {"passed": 0, "failed": [], "skipped": []}
        for case in cases:
            name = f"{case.get('classname')}::{case.get('name')}"
            if case.find("failure") is not None or case.find("error") is not None:
                out["failed"].append(name)
            elif case.find("skipped") is not None:
                out["skipped"].append(name)
            else:
                out["passed"] += 1
        out["tail"] = proc.stdout[-1500:]
        return out


def model_on(device: str, shape: dict) -> Qwen2ForCausalLM:
    """A random Qwen2 of ``shape``, initialised where it runs ("meta": shapes only, no memory)."""
    torch.manual_seed(0)
    with torch.device(device):
        return Qwen2ForCausalLM(Qwen2Config(**shape))


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def grpo_batch(n: int, length: int, vocab: int, device: str) -> RolloutBatch:
    g = torch.Generator().manual_seed(1)
    ids = [torch.randint(3, vocab, (length,), generator=g).to(device) for _ in range(n)]
    masks = [torch.cat([torch.zeros(64), torch.ones(length - 64)]).to(device) for _ in range(n)]
    return RolloutBatch(ids=[f"s{i}" for i in range(n)], input_ids=ids, loss_mask=masks,
                        old_logprobs=[-torch.rand(length, generator=g).to(device) * m for m in masks],
                        advantages=[m * (1.0 if i % 2 else -1.0) for i, m in enumerate(masks)],
                        policy_versions=[0] * n)


def time_steps(device: str, shape: dict, autocast: str | None, n: int, length: int, repeats: int,
               megatron: str | None = None) -> dict:
    """Median seconds of ``repeats`` actor steps after one warm-up, and the peak memory. ``megatron``:
    the Megatron backend's actor with "adamw" or the "distributed" optimizer."""
    cfg = load_config(None, [f"model.dtype={autocast or 'float32'}", "trainer.micro_batch_tokens=4096",
                             "trainer.lr=1e-5", "trainer.warmup_steps=0", "algorithm.off_policy=none"])
    model = model_on(device, shape)
    if megatron is not None:
        from relax.trainers.megatron.policy import megatron_policy

        model = megatron_policy(model, distributed_optimizer=megatron == "distributed")
    actor = Actor(model, cfg)  # the GRPO loss; AdamW and master weights in float32
    batch = grpo_batch(n, length, shape["vocab_size"], device)
    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
    seconds = []
    for _ in range(repeats + 1):
        sync(device)
        t0 = time.perf_counter()
        result = actor.train_step(batch)
        sync(device)
        seconds.append(time.perf_counter() - t0)
        assert not result.skipped, "a non-finite step"
    s = statistics.median(seconds[1:])
    peak = torch.cuda.max_memory_allocated() / 2**30 if device.startswith("cuda") else None
    return {"seconds": round(s, 4), "tokens_per_s": round(n * length / s), "peak_gib": peak and round(peak, 2)}


def time_decode(device: str, shape: dict, batch: int, new: int) -> dict:
    """Tokens/s of the native engine and of HF generate() on one model (median of 3, after a warm-up)."""
    model = model_on(device, shape).eval()
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, shape["vocab_size"], (int(torch.randint(16, 33, (1,), generator=g)),),
                             generator=g).tolist() for _ in range(batch)]
    engine = NativeEngine(model, None, max_batch_size=batch, max_seq_len=128 + new, background=False)

    def native() -> float:
        sync(device)
        t0 = time.perf_counter()
        futures = [engine.submit(GenerateRequest(f"d{i}", p, SamplingParams(max_new_tokens=new, ignore_eos=True)))
                   for i, p in enumerate(prompts)]
        engine.run_until_idle()
        assert all(len(f.result()[0].output_ids) == new for f in futures)
        sync(device)
        return batch * new / (time.perf_counter() - t0)

    def hf() -> float:
        longest = max(len(p) for p in prompts)
        ids = torch.zeros(batch, longest, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, p in enumerate(prompts):  # left padding, as generate() wants
            ids[i, longest - len(p):], mask[i, longest - len(p):] = torch.tensor(p), 1
        sync(device)
        t0 = time.perf_counter()
        with torch.no_grad():
            model.generate(input_ids=ids.to(device), attention_mask=mask.to(device), max_new_tokens=new,
                           min_new_tokens=new, do_sample=True, pad_token_id=0)
        sync(device)
        return batch * new / (time.perf_counter() - t0)

    try:
        native(), hf()  # warm-up
        nat, ref = statistics.median(native() for _ in range(3)), statistics.median(hf() for _ in range(3))
    finally:
        engine.stop()
    return {"native_tokens_per_s": round(nat), "hf_tokens_per_s": round(ref), "native_over_hf": round(nat / ref, 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="a 2-layer model, short batches: the script's own test")
    parser.add_argument("--skip-tests", action="store_true", help="time only; do not run the gpu-marked tests")
    add_arguments(parser)
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    shape = TINY if args.tiny else QWEN25_05B
    n, length, batch, new = (4, 128, 4, 8) if args.tiny else (16, 512, 32, 128)
    result: dict = {"device": torch.cuda.get_device_name() if device == "cuda" else f"cpu x{os.cpu_count()}",
                    "torch": torch.__version__, "model": "tiny" if args.tiny else "Qwen2.5-0.5B shape (random)",
                    "parameters": sum(p.numel() for p in model_on("meta", shape).parameters())}
    if not args.skip_tests:
        result["gpu_tests"] = run_gpu_tests()
    bf16 = time_steps(device, shape, "bfloat16", n, length, 3)
    fp32 = time_steps(device, shape, None, n, length, 3)
    result["actor_step"] = {"samples": n, "tokens_each": length, "bf16": bf16, "fp32": fp32,
                            "bf16_speedup": round(fp32["seconds"] / bf16["seconds"], 2)}
    if importlib.util.find_spec("megatron") is not None:
        steps = {kind: time_steps(device, shape, "bfloat16", n, length, 3, megatron=kind)
                 for kind in ("adamw", "distributed")}
        result["megatron_step"] = {**steps, **{f"{kind}_over_torch": round(bf16["seconds"] / r["seconds"], 2)
                                               for kind, r in steps.items()}}
    result["decode"] = {"batch": batch, "new_tokens": new, **time_decode(device, shape, batch, new)}
    Output.from_args(args).write_json("gpu_check", result)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
