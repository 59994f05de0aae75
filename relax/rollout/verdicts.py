"""What a generative reward model (``genrm``) reads and how its answer becomes a reward.

A judge prompt is a template with three fields: ``{question}`` (the sample's last user message,
media written as ``[image]`` / ``[audio]``), ``{response}`` (the policy's answer) and
``{reference}`` (the sample's reference answer, or ``(none)`` with ``genrm.reference=false``).
Each verdict kind has a built-in template (:data:`TEMPLATES`); ``genrm.template`` may name a text
file of the user's own with the same fields.

Verdict kinds (``genrm.verdict``), each a pure function of the judge's output:

* ``score``: the last ``<score>S</score>`` of the judge's text, S in [0, 1];
* ``boxed``: the last ``\\boxed{S}`` of the text, S in [0, 1];
* ``yes_no``: from the log-probs of the judge's *first* answer token (one token generated, its
  ``genrm.top_logprobs`` likeliest alternatives returned): p(yes) / (p(yes) + p(no)), summing every
  listed token that starts ``yes`` (resp. ``no``) in any case: ``Yes``, `` yes`` and, where the
  vocabulary spells the word over several tokens, ``y``. A probability, not a coin flip, so a
  hesitant judge gives a graded reward.

A verdict that cannot be read (no tag, not a number, neither yes nor no among the listed tokens)
or that is outside [0, 1] is *invalid*: :class:`Verdict` carries why, and the reward role scores it
by ``genrm.invalid`` (reward 0 with zero loss weight, or reward 0 trained) and counts it.
"""

from __future__ import annotations

import hashlib
import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from relax.data.samples import IMAGE_PLACEHOLDER, Sample

NO_REFERENCE = "(none)"

_ASK = "You grade answers to questions.\nQuestion:\n{question}\n\nReference answer: {reference}\n\n" \
       "Response to grade:\n{response}\n\n"
TEMPLATES = {
    "score": _ASK + "Does the response give the reference answer? Reply with <score>1</score> if it does and "
                    "<score>0</score> if it does not (a fraction for partial credit).",
    "boxed": _ASK + "Does the response give the reference answer? Reply with \\boxed{{1}} if it does and "
                    "\\boxed{{0}} if it does not.",
    "yes_no": _ASK + "Does the response give the reference answer? Reply yes or no.",
}

_NUMBER = r"([-+]?(?:\d+\.?\d*|\.\d+))"
_SCORE = re.compile(r"<score>\s*" + _NUMBER + r"\s*</score>")
_BOXED = re.compile(r"\\boxed\{\s*" + _NUMBER + r"\s*\}")


@dataclass(frozen=True)
class Verdict:
    """A judge's reading: ``score`` in [0, 1], or None with ``invalid`` saying why."""

    score: float | None
    invalid: str = ""  # "" when valid; else "unparsable: ...", "out of range: ..." or "too long: ..."

    @property
    def kind(self) -> str:
        """'' (valid), 'unparsable', 'out_of_range' or 'too_long' (the metric it is counted under)."""
        return self.invalid.split(":", 1)[0].replace(" ", "_") if self.invalid else ""


def template_hash(template: str) -> str:
    """What names a judge prompt in lineage: sha256 of its text (16 hex digits)."""
    return hashlib.sha256(template.encode()).hexdigest()[:16]


def question_of(sample: Sample) -> str:
    """The sample's last user message, its media placeholders written as words (a text judge)."""
    users = [m.content for m in sample.messages if m.role == "user"]
    text = users[-1] if users else ""
    return text.replace(IMAGE_PLACEHOLDER, "[image]").replace("<audio>", "[audio]")


def render(template: str, response: str, sample: Sample, reference: bool = True) -> str:
    """The judge's prompt for one ``(response, sample)``."""
    ref = sample.answer if reference and sample.answer is not None else NO_REFERENCE
    return template.format(question=question_of(sample), response=response, reference=ref)


def _in_range(value: float, text: str) -> Verdict:
    if not math.isfinite(value) or not 0.0 <= value <= 1.0:
        return Verdict(None, f"out of range: {value} is not in [0, 1] ({text[:120]!r})")
    return Verdict(value)


def parse_tagged(text: str, pattern: re.Pattern[str], what: str) -> Verdict:
    """The last match of ``pattern`` in ``text`` as a score."""
    found = pattern.findall(text)
    if not found:
        return Verdict(None, f"unparsable: no {what} in {text[:120]!r}")
    return _in_range(float(found[-1]), text)


def parse_score(text: str) -> Verdict:
    """``...<score>0.5</score>`` -> 0.5 (the last tag wins)."""
    return parse_tagged(text, _SCORE, "<score>S</score>")


def parse_boxed(text: str) -> Verdict:
    """``...\\boxed{1}`` -> 1.0 (the last box wins)."""
    return parse_tagged(text, _BOXED, "\\boxed{S}")


def parse_yes_no(top: Sequence[tuple[float, int]], decode: Callable[[int], str]) -> Verdict:
    """p(yes) / (p(yes) + p(no)) over the first answer token's listed ``(logprob, token id)`` pairs.

    ``top``: the k likeliest first tokens (k = ``genrm.top_logprobs``), ``decode(id)`` their text.
    Worked example: yes at log 0.6, "Yes" at log 0.1, no at log 0.3 -> (0.6 + 0.1) / 1.0 = 0.7."""
    p = {"yes": 0.0, "no": 0.0}
    for logprob, token in top:
        word = decode(token).strip().lower()
        for answer in p:  # a small vocabulary spells the answer over tokens: its first one starts it
            if word and answer.startswith(word):
                p[answer] += math.exp(logprob)
    total = p["yes"] + p["no"]
    if total <= 0.0:
        listed = [decode(t) for _, t in top[:5]]
        return Verdict(None, f"unparsable: neither yes nor no among the {len(top)} likeliest first tokens "
                             f"(top: {listed!r})")
    return Verdict(p["yes"] / total)


TEXT_PARSERS: dict[str, Callable[[str], Verdict]] = {"score": parse_score, "boxed": parse_boxed}
VERDICTS = ("score", "boxed", "yes_no")
