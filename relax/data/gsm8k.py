"""GSM8K rows -> Samples, and the GSM8K reward.

GSM8K stores each problem as ``{"question": ..., "answer": "<worked solution>\\n#### 72"}``:
the number after the last ``####`` is the ground truth. Only that number becomes
``Sample.answer`` (so numeric rewards compare like with like); the worked solution is kept
in ``metadata["solution"]`` for SFT warm-up or inspection.

Reading files is not done here: pair this with ``relax.data.readers.iter_records(url)``,
which yields ``(record, "file:line")``::

    samples = [gsm8k_row_to_sample(rec, where, i) for i, (rec, where) in enumerate(iter_records(url))]
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from relax.data.errors import DataError
from relax.data.samples import Message, Sample
from relax.data.verifiers import ANSWER_FORMAT_HINT, normalize_answer, numeric_match_reward, parse_number

TASK_NAME = "gsm8k"
MARKER = "####"


def _text_field(record: Mapping[str, Any], field: str, where: str) -> str:
    value = record.get(field)
    if value is None:
        raise DataError(f"{where}: GSM8K row has no {field!r} field; each row needs 'question' and 'answer'")
    if not isinstance(value, str) or not value.strip():
        raise DataError(f"{where}: GSM8K field {field!r} must be a non-empty string, got {value!r:.60}")
    return value


def final_answer_of(solution: str, where: str) -> str:
    """The ground truth in a GSM8K solution: the text after the last ``####``, commas and ``$`` removed."""
    if MARKER not in solution:
        raise DataError(
            f"{where}: GSM8K field 'answer' has no '{MARKER}'; it must end with '{MARKER} <number>' "
            f"as in the original dataset"
        )
    final = solution.rsplit(MARKER, 1)[1].strip().replace(",", "").replace("$", "").strip()
    if parse_number(final) is None:
        raise DataError(
            f"{where}: GSM8K field 'answer' has {final!r} after '{MARKER}', which is not a number; "
            f"write the final answer as a plain number, e.g. '{MARKER} 72'"
        )
    return normalize_answer(final)


def gsm8k_row_to_sample(record: dict[str, Any], where: str, index: int) -> Sample:
    """One GSM8K row as a :class:`Sample` with id ``gsm8k-<index>``; ``where`` prefixes errors."""
    if not isinstance(record, Mapping):
        raise DataError(f"{where}: a GSM8K row must be a JSON object, got {type(record).__name__}")
    question = _text_field(record, "question", where)
    solution = _text_field(record, "answer", where)
    return Sample(
        id=f"{TASK_NAME}-{index:06d}",
        task=TASK_NAME,
        messages=(Message("user", f"{question.strip()}\n{ANSWER_FORMAT_HINT}"),),
        answer=final_answer_of(solution, where),
        metadata={"solution": solution, "source": where},
    )


def gsm8k_reward(response: str, sample: Sample) -> float:
    """1.0 if the response's final answer (``<answer>``, ``\\boxed{}``, ``####``, ...) equals the
    ground-truth number, else 0.0. A :data:`~relax.data.suite.base.RewardFn`."""
    return numeric_match_reward(response, sample)
