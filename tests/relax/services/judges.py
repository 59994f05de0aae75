"""Tiny judges for GenRM tests: made here in seconds, saved as Hugging Face folders.

``yes_judge`` answers "yes" (its first token ``y``) to every judge prompt, so a reward the judge
gave is ~1 and tells itself apart from the verifier's (a fresh policy is right on ~0 of the rows).
The judge that actually grades a task is relax.trainers.torch.judge_sft's.
"""

from __future__ import annotations

import random

import torch

from relax.config import ModelConfig
from relax.data.suite import TASKS
from relax.models import build_policy, build_tokenizer
from relax.rollout.prompts import encode_prompt
from relax.rollout.verdicts import TEMPLATES, render


def yes_judge(out_dir: str, steps: int = 30, seed: int = 0) -> str:
    """Train a tiny Qwen2 to start every answer with ``y``; save it (and bpe-tiny) in ``out_dir``."""
    tok = build_tokenizer("bpe-tiny")
    model, _ = build_policy(ModelConfig(), tok, seed=seed)
    samples = TASKS["arithmetic"].generate(seed, "train", 16, 1)
    rng = random.Random(seed)
    prompts = [encode_prompt([{"role": "user", "content": render(TEMPLATES["yes_no"], f"<answer>{rng.randint(0, 30)}"
                                                                  f"</answer>", s)}], [], [], tok, None).input_ids
               for s in samples]
    target = tok.encode("y", add_special_tokens=False)[0]
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    torch.manual_seed(seed)
    for step in range(steps):
        ids = torch.tensor([prompts[step % len(prompts)]])
        logits = model(input_ids=ids).logits[0, -1]
        loss = torch.nn.functional.cross_entropy(logits[None], torch.tensor([target]))
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.save_pretrained(out_dir)
    tok.save_pretrained(out_dir)
    return out_dir


def nudged(src: str, out_dir: str) -> str:
    """``src``'s judge with one weight moved: another judge at a glance-identical folder."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(src, local_files_only=True)
    with torch.no_grad():
        next(model.parameters()).add_(1e-3)
    model.save_pretrained(out_dir)
    build_tokenizer("bpe-tiny").save_pretrained(out_dir)
    return out_dir
