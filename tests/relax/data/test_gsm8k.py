"""GSM8K rows -> Samples, and the GSM8K reward, on rows written by hand."""

from __future__ import annotations

import json

import pytest

from relax.config import DataConfig
from relax.data.errors import DataError
from relax.data.gsm8k import gsm8k_reward, gsm8k_row_to_sample
from relax.data.sources import plan_from_config

ROW = {
    "question": "Natalia sold clips to 48 friends in April, and half as many in May. How many in total?",
    "answer": "In May she sold 48/2 = <<48/2=24>>24 clips.\nIn total 48+24 = <<48+24=72>>72 clips.\n#### 72",
}


def test_row_to_sample_fields() -> None:
    sample = gsm8k_row_to_sample(ROW, "train.jsonl:1", 0, "train")
    assert sample.id == "gsm8k-train-000000"
    assert sample.task == "gsm8k"
    assert sample.answer == "72"
    assert sample.metadata["solution"] == ROW["answer"]
    assert sample.metadata["source"] == "train.jsonl:1"
    assert len(sample.messages) == 1 and sample.messages[0].role == "user"
    assert sample.prompt_text.startswith("Natalia sold clips")
    # the worked solution must not leak into the prompt
    assert "<<48/2=24>>" not in sample.prompt_text


def test_split_and_index_make_the_id() -> None:
    assert gsm8k_row_to_sample(ROW, "x:13", 12, "train").id == "gsm8k-train-000012"
    assert gsm8k_row_to_sample(ROW, "x:13", 12, "eval").id == "gsm8k-eval-000012"


def write_gsm8k(path, questions: list[str]) -> str:
    path.write_text("".join(json.dumps({"question": q, "answer": f"So it is {i}.\n#### {i}"}) + "\n"
                            for i, q in enumerate(questions)))
    return str(path)


def test_gsm8k_train_and_test_files_snapshot_together(tmp_path) -> None:
    # GSM8K ships train.jsonl and test.jsonl, each counted from row 0: ids from the row index alone collided
    data = DataConfig(train_url=write_gsm8k(tmp_path / "train.jsonl", [f"train question {i}?" for i in range(5)]),
                      eval_url=write_gsm8k(tmp_path / "test.jsonl", [f"test question {i}?" for i in range(3)]),
                      format="gsm8k")
    plan = plan_from_config(data)
    ids = {split: [json.loads(line)["id"] for line in rows.decode().splitlines()] for split, rows in plan.rows.items()}
    assert ids == {"train": [f"gsm8k-train-{i:06d}" for i in range(5)],
                   "eval": [f"gsm8k-eval-{i:06d}" for i in range(3)]}
    assert plan_from_config(data).id == plan.id  # stable: the same files give the same snapshot


def test_a_misspelled_field_is_named() -> None:
    with pytest.raises(DataError, match="has no 'question' field \\(it has 'questoin': rename it to 'question'\\)"):
        gsm8k_row_to_sample({"questoin": "q?", "answer": "#### 1"}, "f:1", 0, "train")


@pytest.mark.parametrize(
    ("answer_field", "expected"),
    [
        ("... so 1000+200 = 1200\n#### 1,200", "1200"),  # thousands comma removed
        ("The total is $1,200.\n#### $1,200", "1200"),  # dollar sign and comma removed
        ("He ends with 5-8 = -3 dollars\n#### -3", "-3"),  # negative kept
        ("#### 1 #### 2.50", "2.5"),  # last marker wins, canonical number
    ],
)
def test_final_answer_formats(answer_field: str, expected: str) -> None:
    sample = gsm8k_row_to_sample({"question": "q?", "answer": answer_field}, "f:1", 0, "train")
    assert sample.answer == expected


def test_reward_right_and_wrong() -> None:
    sample = gsm8k_row_to_sample(ROW, "f:1", 0, "train")
    assert gsm8k_reward("48 + 24 = 72\n#### 72", sample) == 1.0
    assert gsm8k_reward("So she sold <answer>72</answer> clips.", sample) == 1.0
    assert gsm8k_reward("\\boxed{72.0}", sample) == 1.0
    assert gsm8k_reward("#### 71", sample) == 0.0
    assert gsm8k_reward("", sample) == 0.0


def test_reward_with_commas_and_dollars() -> None:
    sample = gsm8k_row_to_sample({"question": "q?", "answer": "#### $1,200"}, "f:1", 0, "train")
    assert gsm8k_reward("The answer is $1,200.", sample) == 1.0
    assert gsm8k_reward("<answer>1200</answer>", sample) == 1.0
    assert gsm8k_reward("<answer>120</answer>", sample) == 0.0


def test_reward_negative() -> None:
    sample = gsm8k_row_to_sample({"question": "q?", "answer": "#### -3"}, "f:1", 0, "train")
    assert gsm8k_reward("#### -3", sample) == 1.0
    assert gsm8k_reward("#### 3", sample) == 0.0


@pytest.mark.parametrize(
    ("row", "fragment"),
    [
        ({"answer": "#### 1"}, "'question'"),
        ({"question": "q?"}, "'answer'"),
        ({"question": "q?", "answer": None}, "'answer'"),
        ({"question": "", "answer": "#### 1"}, "'question'"),
        ({"question": 5, "answer": "#### 1"}, "'question'"),
        ({"question": "q?", "answer": "72"}, "####"),  # no marker
        ({"question": "q?", "answer": "#### seventy"}, "not a number"),
    ],
)
def test_malformed_rows_name_the_place_and_field(row: dict, fragment: str) -> None:
    with pytest.raises(DataError) as err:
        gsm8k_row_to_sample(row, "gsm8k/train.jsonl:7", 6, "train")
    assert "gsm8k/train.jsonl:7" in str(err.value)
    assert fragment in str(err.value)


def test_non_object_row() -> None:
    with pytest.raises(DataError, match="f:2: a GSM8K row must be a JSON object"):
        gsm8k_row_to_sample(["q", "a"], "f:2", 1, "train")  # type: ignore[arg-type]
