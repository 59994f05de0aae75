"""Judge-model rewards: a language model behind any OpenAI-compatible chat route grades each
response (``data.judge_url``).

The judge is a service, not a library: a native Relax engine (``python -m
relax.engines.server``), SGLang or vLLM serving ``/v1/chat/completions``, on its own GPUs or
host. The rollout sends it one chat request per response, many at once, and reads a score
in [0, 1] from ``<score>S</score>`` in the answer. An answer without a score, an HTTP error or
a timeout raises :class:`JudgeError`; the reward dispatcher turns that into reward 0 with
zero loss weight and the judge's text in the sample's ``error`` field, as for any reward
function that fails, so a flaky judge never stops the run and never trains on a guess.
"""

from __future__ import annotations

import json
import os
import re
import urllib.error
import urllib.request
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from relax.data.samples import Sample
from relax.rollout.verdicts import question_of

API_KEY_ENV = "RELAX_JUDGE_API_KEY"

DEFAULT_TEMPLATE = (
    "You grade answers to questions.\n"
    "Question:\n{question}\n\n"
    "Reference answer: {answer}\n\n"
    "Response to grade:\n{response}\n\n"
    "Does the response give the reference answer? Reply with <score>1</score> if it does and "
    "<score>0</score> if it does not (a fraction for partial credit)."
)
SCORE = re.compile(r"<score>\s*([-+]?(?:\d+\.?\d*|\.\d+))\s*</score>")


class JudgeError(RuntimeError):
    """The judge gave no usable score (unreachable, HTTP error, timeout, or no <score> tag)."""


class JudgeReward:
    """``judge(response, sample) -> float`` (a :data:`~relax.data.suite.base.RewardFn`), and
    :meth:`many` to grade a whole batch with up to ``concurrency`` requests in flight."""

    def __init__(self, url: str, model: str = "judge", *, template: str = DEFAULT_TEMPLATE,
                 timeout_s: float = 60.0, max_tokens: int = 32, concurrency: int = 16, api_key: str | None = None):
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"data.judge_url {url!r} must be an http(s) URL of an OpenAI-compatible server")
        base = url.rstrip("/")
        self.endpoint = base + ("/chat/completions" if base.endswith("/v1") else "/v1/chat/completions")
        self.model, self.template, self.timeout_s = model, template, timeout_s
        self.max_tokens, self.concurrency = max_tokens, concurrency
        self.api_key = api_key or os.environ.get(API_KEY_ENV) or None

    def __repr__(self) -> str:  # how the reward dispatcher names it in a sample's error
        return f"judge at {self.endpoint}"

    def prompt(self, response: str, sample: Sample) -> str:
        return self.template.format(question=question_of(sample), answer=sample.answer, response=response)

    def __call__(self, response: str, sample: Sample) -> float:
        body = {"model": self.model, "messages": [{"role": "user", "content": self.prompt(response, sample)}],
                "temperature": 0.0, "max_tokens": self.max_tokens}
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        req = urllib.request.Request(self.endpoint, data=json.dumps(body).encode(), headers=headers, method="POST")
        try:
            with urllib.request.urlopen(req, timeout=self.timeout_s) as r:
                answer = json.loads(r.read())
        except urllib.error.HTTPError as e:
            raise JudgeError(f"HTTP {e.code}: {e.read()[:300].decode(errors='replace')}") from None
        except (urllib.error.URLError, OSError) as e:  # refused, reset, timed out
            raise JudgeError(f"no answer within {self.timeout_s:.0f} s: {getattr(e, 'reason', e)}") from None
        return parse_score(answer)

    def many(self, pairs: Sequence[tuple[str, Sample]]) -> list[float | BaseException]:
        """Scores of ``(response, sample)`` pairs in order; a failed one is its exception."""
        def one(pair: tuple[str, Sample]) -> float | BaseException:
            try:
                return self(*pair)
            except Exception as e:  # returned, not raised: one bad grade must not lose the batch
                return e

        if len(pairs) <= 1:
            return [one(p) for p in pairs]
        with ThreadPoolExecutor(max_workers=min(self.concurrency, len(pairs)), thread_name_prefix="relax-judge") as ex:
            return list(ex.map(one, pairs))


def parse_score(answer: Any) -> float:
    """The score in an OpenAI chat completion: the last ``<score>S</score>`` of its first choice."""
    try:
        text = answer["choices"][0]["message"]["content"] or ""
    except (KeyError, IndexError, TypeError):
        raise JudgeError(f"not a chat completion: {str(answer)[:300]}") from None
    found = SCORE.findall(text)
    if not found:
        raise JudgeError(f"the judge's answer has no <score>S</score>: {text[:200]!r}")
    score = float(found[-1])
    if not 0.0 <= score <= 1.0:
        raise JudgeError(f"the judge's score {score} is outside [0, 1]: {text[:200]!r}")
    return score


def judge_from_config(data: Any) -> JudgeReward | None:
    """The judge of a ``DataConfig`` (``data.judge_*``), or None without ``judge_url``."""
    if not data.judge_url:
        return None
    return JudgeReward(data.judge_url, data.judge_model, timeout_s=data.judge_timeout_s,
                       concurrency=data.judge_concurrency)
