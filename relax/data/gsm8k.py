"""GSM8K rows -> Samples, and the GSM8K reward.

GSM8K stores each problem as ``{"question": ..., "answer": "<worked solution>\\n#### 72"}``:
the number after the last ``####`` is the ground truth. Only that number becomes
``Sample.answer`` (so numeric rewards compare like with like); the worked solution is kept
in ``metadata["solution"]`` for SFT warm-up or inspection.

Reading files is not done here: pair this with ``relax.data.readers.iter_records(url)``,
which yields ``(record, "file:line")``::

    samples = [gsm8k_row_to_sample(rec, where, i, "train") for i, (rec, where) in enumerate(iter_records(url))]

GSM8K rows carry no id, so a row's id is made from the file it came from and its place there,
``gsm8k-train-000012`` (``data.train_url``) or ``gsm8k-eval-000012`` (``data.eval_url``): stable
across runs, and GSM8K's own train and test files, which both start at row 0, never collide.
Other fields of a row are ignored (exports often carry extra columns); a misspelled ``question``
or ``answer`` is named by the error about the missing field.
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from typing import Any

from relax.data.errors import DataError
from relax.data.samples import Message, Sample
from relax.data.verifiers import ANSWER_FORMAT_HINT, normalize_answer, numeric_match_reward, parse_number

TASK_NAME = "gsm8k"
MARKER = "####"
QUESTION, ANSWER = "question", "answer"
SPLITS = ("train", "eval")  # which of the config's files a row came from: part of its id


def _text_field(record: Mapping[str, Any], field: str, where: str) -> str:
    value = record.get(field)
    if value is None:
        close = difflib.get_close_matches(field, [str(k) for k in record if k not in (QUESTION, ANSWER)], n=1)
        hint = f" (it has {close[0]!r}: rename it to {field!r})" if close else ""
        raise DataError(f"{where}: GSM8K row has no {field!r} field{hint}; each row needs 'question' and 'answer'")
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


def gsm8k_row_to_sample(record: dict[str, Any], where: str, index: int, split: str) -> Sample:
    """Row ``index`` of the ``split`` file as a :class:`Sample` with id ``gsm8k-<split>-<index>``;
    ``where`` prefixes errors."""
    if split not in SPLITS:
        raise ValueError(f"split {split!r} is not one of {SPLITS}")
    if not isinstance(record, Mapping):
        raise DataError(f"{where}: a GSM8K row must be a JSON object, got {type(record).__name__}")
    question = _text_field(record, QUESTION, where)
    solution = _text_field(record, ANSWER, where)
    return Sample(
        id=f"{TASK_NAME}-{split}-{index:06d}",
        task=TASK_NAME,
        messages=(Message("user", f"{question.strip()}\n{ANSWER_FORMAT_HINT}"),),
        answer=final_answer_of(solution, where),
        metadata={"solution": solution, "source": where},
    )


def gsm8k_reward(response: str, sample: Sample) -> float:
    """1.0 if the response's final answer (``<answer>``, ``\\boxed{}``, ``####``, ...) equals the
    ground-truth number, else 0.0. A :data:`~relax.data.suite.base.RewardFn`."""
    return numeric_match_reward(response, sample)
