"""Turning a model's free-form response into a final answer and scoring it.

Policies write answers in many styles: ``<answer>7</answer>``, ``\\boxed{7}``, GSM8K's
``#### 7``, ``The answer is 7.``, or just ``7`` on the last line. Rewards in RL must be
strict enough not to be gamed and lenient enough not to punish harmless formatting, so
extraction and normalization live here, once, and every task's reward goes through them.

The reward functions below follow the :data:`relax.data.suite.base.RewardFn` contract:
``reward(response: str, sample: Sample) -> float`` with a value in ``[0, 1]``.
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation
from fractions import Fraction

from relax.data.samples import Sample

#: Appended to prompts so the policy knows the format the extractor prefers.
ANSWER_FORMAT_HINT = "Put your final answer inside <answer></answer>."

#: Longest last line accepted as an answer when no explicit marker is present; longer lines
#: are most likely reasoning cut off mid-sentence, not an answer.
MAX_BARE_ANSWER_CHARS = 32

_ANSWER_TAG_RE = re.compile(r"<answer>(.*?)</answer>", re.IGNORECASE | re.DOTALL)
_BOXED_RE = re.compile(r"\\boxed\s*\{")
_HASHES_RE = re.compile(r"####[ \t]*([^\n]*)")
_PHRASE_RE = re.compile(r"(?:\banswer\s*:|\bthe\s+answer\s+is\b:?)[ \t]*([^\n]*)", re.IGNORECASE)
_THOUSANDS_RE = re.compile(r"(?<=\d),(?=\d{3}(?!\d))")
_ARTICLES_RE = re.compile(r"\b(?:a|an|the)\b")
_NUMBER_RE = re.compile(r"^[-+]?(?:\d+\.?\d*|\.\d+)(?:e[-+]?\d+)?$")
_FRACTION_RE = re.compile(r"^([-+]?\d+)\s*/\s*(\d+)$")
_NUMBER_IN_TEXT_RE = re.compile(r"[-+]?\d[\d,]*(?:\.\d+)?|[-+]?\.\d+")
_EDGE_PUNCT = " \t\r\n,;:!?\"'`*()[]{}"


def _last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}``, honouring nested braces (``\\boxed{\\frac{1}{2}}``)."""
    starts = [m.end() for m in _BOXED_RE.finditer(text)]
    for start in reversed(starts):
        depth = 1
        for i in range(start, len(text)):
            if text[i] == "{":
                depth += 1
            elif text[i] == "}":
                depth -= 1
                if depth == 0:
                    return text[start:i]
    return None


def _last_match(pattern: re.Pattern[str], text: str) -> str | None:
    matches = pattern.findall(text)
    return matches[-1] if matches else None


def _clean(candidate: str | None) -> str | None:
    if candidate is None:
        return None
    cleaned = candidate.strip().rstrip(".").strip()
    return cleaned or None


def extract_final_answer(text: str) -> str | None:
    """The final answer in ``text``, or ``None`` when none can be found.

    Formats are tried in order and the first one present decides (within it, the last
    occurrence wins, since models often restate a draft answer before correcting it):

    1. ``<answer>X</answer>``
    2. ``\\boxed{X}``
    3. ``#### X`` (GSM8K)
    4. ``Answer: X`` / ``The answer is X`` (case-insensitive; rest of that line)
    5. the last non-empty line, without trailing punctuation, if at most
       :data:`MAX_BARE_ANSWER_CHARS` characters long.

    An empty answer (``<answer></answer>``) gives ``None``.
    """
    if not text:
        return None
    tag = _last_match(_ANSWER_TAG_RE, text)
    if tag is not None:
        return _clean(tag)
    boxed = _last_boxed(text)
    if boxed is not None:
        return _clean(boxed)
    for pattern in (_HASHES_RE, _PHRASE_RE):
        found = _last_match(pattern, text)
        if found is not None:
            return _clean(found)
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    if not lines:
        return None
    last = lines[-1].rstrip(".!?;:,").strip()
    if not last or len(last) > MAX_BARE_ANSWER_CHARS:
        return None
    return last


def _canonical_number(s: str) -> str | None:
    """``"7.0"`` -> ``"7"``, ``"+3.50"`` -> ``"3.5"``; ``None`` if ``s`` is not a plain number."""
    if not _NUMBER_RE.match(s):
        return None
    try:
        value = Decimal(s)
    except InvalidOperation:
        return None
    if value == value.to_integral_value():
        return str(int(value))
    return format(value.normalize(), "f")


def normalize_answer(s: str) -> str:
    """Canonical form for comparing answers: case, spacing and formatting are ignored.

    Lowercases, drops ``$``, thousands separators (``1,200`` -> ``1200``), surrounding
    punctuation and the articles a/an/the, collapses whitespace, and writes numbers
    canonically (``7.0`` -> ``7``, ``+3`` -> ``3``). A leading minus sign is kept.
    """
    s = s.lower().replace("$", "")
    s = _THOUSANDS_RE.sub("", s)
    s = s.strip(_EDGE_PUNCT).rstrip(".").strip(_EDGE_PUNCT)
    without_articles = " ".join(_ARTICLES_RE.sub(" ", s).split())
    s = without_articles or " ".join(s.split())  # a bare "a" (a choice label) stays
    number = _canonical_number(s)
    return number if number is not None else s


def parse_number(s: str) -> Fraction | None:
    """``s`` as an exact number (integers, decimals, ``a/b``, ``$1,200``), else ``None``."""
    text = normalize_answer(s)
    frac = _FRACTION_RE.match(text)
    if frac:
        numerator, denominator = int(frac.group(1)), int(frac.group(2))
        return Fraction(numerator, denominator) if denominator else None
    if _canonical_number(text) is None:
        return None
    return Fraction(Decimal(text))


def numbers_equal(a: str | int | float, b: str | int | float) -> bool:
    """Whether ``a`` and ``b`` denote the same number (``"1,200"`` == ``"1200.0"`` == ``1200``).

    Exact for integers and decimals; a relative tolerance of 1e-6 absorbs float round-off.
    Anything that is not a number compares unequal.
    """
    x, y = parse_number(str(a)), parse_number(str(b))
    if x is None or y is None:
        return False
    if x == y:
        return True
    return abs(x - y) <= Fraction(1, 10**6) * max(1, abs(x), abs(y))


def _last_number(text: str) -> str | None:
    found = _NUMBER_IN_TEXT_RE.findall(text)
    return found[-1] if found else None


def given_answer(response: str) -> str | None:
    """The final answer in ``response`` normalised as :func:`exact_match_reward` compares it;
    ``None`` when there is none. The evaluation's per-kind confusion records this."""
    predicted = extract_final_answer(response)
    return None if predicted is None else normalize_answer(predicted)


def exact_match_reward(response: str, sample: Sample) -> float:
    """1.0 if the extracted final answer equals ``sample.answer`` after normalization, else 0.0."""
    given = given_answer(response)
    if given is None:
        return 0.0
    return 1.0 if given == normalize_answer(sample.answer) else 0.0


def numeric_match_reward(response: str, sample: Sample) -> float:
    """1.0 if the extracted final answer is the number ``sample.answer``, else 0.0.

    When the extracted answer carries words (``"42 apples"``, ``"3 + 4 = 7"``), its last
    number is compared, so units and restated equations do not cost the reward.
    """
    predicted = extract_final_answer(response)
    if predicted is None:
        return 0.0
    if numbers_equal(predicted, sample.answer):
        return 1.0
    last = _last_number(predicted)
    return 1.0 if last is not None and numbers_equal(last, sample.answer) else 0.0


def answer_match_reward(response: str, sample: Sample) -> float:
    """:func:`numeric_match_reward` when ``sample.answer`` is a number (``7``, ``1,200``, ``3/4``), else
    :func:`exact_match_reward`: the default verifier of rows whose task is not built in (``custom``).

    Why both: a numeric match alone never rewards a word answer (``<answer>red</answer>`` for
    ``red`` scored 0, so a dataset of labels trained on an all-zero reward), and an exact match
    alone would refuse ``7 apples`` for ``7``."""
    if parse_number(sample.answer) is not None:
        return numeric_match_reward(response, sample)
    return exact_match_reward(response, sample)


def integer_distance(response: str, sample: Sample) -> int | None:
    """``|predicted - sample.answer|`` when both the extracted answer and the truth are integers, else None.

    What near-miss credit measures on count questions: ``"<answer>3</answer>"`` against a truth
    of ``"4"`` is 1; a colour word, a fraction or no answer at all is None, never a near miss."""
    predicted = extract_final_answer(response)
    if predicted is None:
        return None
    x, y = parse_number(predicted), parse_number(sample.answer)
    if x is None or y is None or x.denominator != 1 or y.denominator != 1:
        return None
    return abs(int(x) - int(y))
