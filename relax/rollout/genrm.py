"""A generative reward model over an engine pool: a rollout batch judged in one batched call.

:class:`GenRMJudge` renders a judge prompt per ``(response, sample)`` (relax.rollout.verdicts),
sends them all as one ``generate`` to its :class:`~relax.rollout.engine_pool.EnginePool` (an
in-process engine, or engine servers behind the router, which splits the call into one batched
``/generate`` per engine and fails a share over to another engine when one dies), and reads each
answer's verdict. The request ids are the rows' ids, and an engine seeds each request from its id,
so a batch judged again after a crash gets the same verdicts.

The judge is frozen: the pool never loads a weight version, so the policy's versions can never
reach it (nor its weights the policy's engines: each pool holds its own model).
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from relax.data.samples import Sample
from relax.engines.types import SamplingParams
from relax.rollout.engine_pool import EnginePool
from relax.rollout.prompts import EncodedPrompt, encode_prompt
from relax.rollout.rewards import Scored
from relax.rollout.verdicts import TEXT_PARSERS, Verdict, parse_yes_no, render


@dataclass(frozen=True)
class JudgeSpec:
    """How the judge is asked and read (the ``genrm`` config section's prompt and verdict fields)."""

    template: str
    verdict: str = "yes_no"  # relax.rollout.verdicts.VERDICTS
    reference: bool = True
    top_logprobs: int = 20
    max_new_tokens: int = 32
    invalid: str = "skip"  # skip | zero

    def sampling(self, rid_seed: int | None = None) -> SamplingParams:
        """yes_no: one token at the model's own distribution, its likeliest alternatives listed; else greedy text."""
        if self.verdict == "yes_no":
            return SamplingParams(max_new_tokens=1, temperature=1.0, top_logprobs_num=self.top_logprobs,
                                  sampling_seed=rid_seed)
        return SamplingParams(max_new_tokens=self.max_new_tokens, temperature=0.0, sampling_seed=rid_seed)


def judge_prompt(template: str, response: str, sample: Sample, tokenizer: Any, reference: bool = True) -> EncodedPrompt:
    """The judge's prompt for one row: ``template`` rendered (relax.rollout.verdicts) as the user turn of the
    judge's chat template, token ids ready for its engines (what a trained judge must be trained on)."""
    text = render(template, response, sample, reference)
    return encode_prompt([{"role": "user", "content": text}], [], [], tokenizer, None)


class GenRMJudge:
    """``score_many(pairs, ids) -> list[Scored]``, as the reward dispatcher's, with verdict counts kept."""

    def __init__(self, pool: EnginePool, tokenizer: Any, spec: JudgeSpec, identity: dict[str, Any],
                 context: int | None = None):
        self.pool, self.tokenizer, self.spec, self.identity = pool, tokenizer, spec, identity
        self.context = context  # the judge's context in tokens; None = unknown (a URL pool's servers check it)
        self.counts = {"judged": 0, "unparsable": 0, "out_of_range": 0, "too_long": 0}
        self.last: dict[str, float] = {}  # the last batch's figures (relax.services.roles.reward's metrics)

    def prompt(self, response: str, sample: Sample) -> EncodedPrompt:
        return judge_prompt(self.spec.template, response, sample, self.tokenizer, self.spec.reference)

    def verdict(self, completion: Any) -> Verdict:
        if self.spec.verdict == "yes_no":
            top = (completion.top_logprobs or [[]])[0]
            return parse_yes_no(top, lambda t: self.tokenizer.decode([t]))
        text = self.tokenizer.decode(completion.output_ids, skip_special_tokens=True)
        return TEXT_PARSERS[self.spec.verdict](text)

    def verdicts(self, pairs: Sequence[tuple[str, Sample]], ids: Sequence[str]) -> list[Verdict]:
        """One verdict per pair, from one batched generate; raises what the pool raises (no engine left)."""
        if not pairs:
            return []
        prompts = [self.prompt(r, s) for r, s in pairs]
        params = [self.spec.sampling() for _ in pairs]
        # a row whose judge prompt cannot fit is its own invalid verdict, never a failed batch
        fits = [self._too_long(p, sp) for p, sp in zip(prompts, params, strict=True)]
        keep = [i for i, why in enumerate(fits) if why is None]
        t0 = time.perf_counter()
        out = self.pool.generate([prompts[i] for i in keep], [params[i] for i in keep],
                                 [f"genrm-{ids[i]}" for i in keep]) if keep else []
        verdicts: list[Verdict] = [Verdict(None, why) if why else Verdict(None) for why in fits]
        for i, per_prompt in zip(keep, out, strict=True):
            verdicts[i] = self.verdict(per_prompt[0])
        valid = [v.score for v in verdicts if v.score is not None]
        self.last = {"genrm/judge_s": time.perf_counter() - t0,
                     "genrm/score_mean": math.fsum(valid) / len(valid) if valid else float("nan"),
                     "genrm/invalid": float(sum(v.score is None for v in verdicts))}
        return verdicts

    def _too_long(self, prompt: EncodedPrompt, params: SamplingParams) -> str | None:
        n = len(prompt.input_ids)
        if self.context is None or n + params.max_new_tokens <= self.context:
            return None
        return (f"too long: the judge prompt has {n} tokens and the verdict up to {params.max_new_tokens}, over the "
                f"judge's context of {self.context}; shorten genrm.template or genrm.max_new_tokens, or use a judge "
                f"with a longer context")

    def score_many(self, pairs: Sequence[tuple[str, Sample]], ids: Sequence[str] | None = None) -> list[Scored]:
        """Rewards of ``(response, sample)`` pairs; an invalid verdict by ``spec.invalid`` (module docstring)."""
        ids = list(ids) if ids is not None else [s.id for _, s in pairs]
        out = []
        for verdict in self.verdicts(pairs, ids):
            self.counts["judged"] += 1
            if verdict.score is not None:
                out.append(Scored(verdict.score))
                continue
            self.counts[verdict.kind] += 1
            out.append(Scored(0.0, "" if self.spec.invalid == "zero" else f"genrm verdict invalid: {verdict.invalid}"))
        return out

    def metrics(self) -> dict[str, float]:
        """The last batch's figures and the run's verdict counts so far (``genrm/...``), with the pool's size."""
        engines = getattr(self.pool, "router", None)
        return {**self.last, **{f"genrm/{k}_total": float(v) for k, v in self.counts.items()},
                "genrm/engines": float(len(engines.engines()) if engines is not None else 1)}

    def close(self) -> None:
        self.pool.close()
