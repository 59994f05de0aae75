"""The task registry and suite: determinism, split hygiene, baselines, rewards, reward loading."""

from __future__ import annotations

import hashlib
import time

import pytest

from relax.data.errors import DataError
from relax.data.samples import Sample
from relax.data.suite import TASKS, generate_suite, get_task, load_reward_fn, random_policy_score
from relax.data.suite.base import Env, derive_seed, split_of
from relax.data.verifiers import exact_match_reward, numeric_match_reward

# flash_beep (video) is left out of the suite-wide tests here: an MP4 costs ~15 ms to write, and
# its own module (test_flash_beep.py) checks it on a few clips
VIDEO_TASKS = ("flash_beep",)
ALL = sorted(set(TASKS) - set(VIDEO_TASKS))
DIFFICULTIES = (1, 2, 3)


def fingerprint(sample: Sample) -> str:
    """Question text plus the hashes of its media: what a model actually sees."""
    h = hashlib.sha256(sample.prompt_text.encode())
    for ref in (*sample.images, *sample.audios):
        h.update(hashlib.sha256(ref.data or b"").digest())
    return h.hexdigest()


@pytest.fixture(scope="module")
def suite() -> dict[str, list[Sample]]:
    return generate_suite(ALL, seed=7, train_per_task=40, eval_per_task=20, difficulty=2)


def test_registry_has_the_six_tasks() -> None:
    assert sorted(TASKS) == ["arithmetic", "flash_beep", "largest", "shapes", "tones", "tool_lookup"]
    assert {t.modality for t in TASKS.values()} == {"text", "image", "audio", "video"}
    assert TASKS["tool_lookup"].make_env is not None
    assert isinstance(TASKS["tool_lookup"].make_env(), Env)


def test_suite_shape_and_ids(suite: dict[str, list[Sample]]) -> None:
    assert len(suite["train"]) == 5 * 40 and len(suite["eval"]) == 5 * 20
    ids = [s.id for split in ("train", "eval") for s in suite[split]]
    assert len(ids) == len(set(ids))
    assert suite["train"][12].id == "arithmetic-train-000012"
    assert suite["eval"][-1].id == "tool_lookup-eval-000019"
    assert all(s.metadata["difficulty"] == 2 for s in suite["train"])


def test_same_arguments_give_identical_samples(suite: dict[str, list[Sample]]) -> None:
    again = generate_suite(ALL, seed=7, train_per_task=40, eval_per_task=20, difficulty=2)
    # dataclass equality compares media bytes too
    assert again == suite


def test_a_different_seed_gives_different_samples(suite: dict[str, list[Sample]]) -> None:
    other = generate_suite(ALL, seed=8, train_per_task=40, eval_per_task=20, difficulty=2)
    for name in ALL:
        mine = [fingerprint(s) for s in suite["train"] if s.task == name]
        theirs = [fingerprint(s) for s in other["train"] if s.task == name]
        assert mine != theirs, name


def test_a_task_does_not_depend_on_the_others_or_on_n() -> None:
    alone = generate_suite(["shapes"], seed=7, train_per_task=10, eval_per_task=5, difficulty=2)
    full = generate_suite(ALL, seed=7, train_per_task=40, eval_per_task=20, difficulty=2)
    assert alone["train"] == [s for s in full["train"] if s.task == "shapes"][:10]


def test_train_and_eval_are_disjoint(suite: dict[str, list[Sample]]) -> None:
    train = {fingerprint(s) for s in suite["train"]}
    assert not [s.id for s in suite["eval"] if fingerprint(s) in train]
    # the stronger guarantee: the same question text never appears in both, except for the
    # media tasks whose two question wordings are shared and whose pictures/clips differ
    train_text = {(s.task, s.prompt_text) for s in suite["train"]
                  if s.task in ("arithmetic", "largest", "tool_lookup")}
    assert not [s.id for s in suite["eval"] if (s.task, s.prompt_text) in train_text]


def test_split_is_a_fixed_fifth_of_the_question_space() -> None:
    # split_of takes no seed: membership is a property of the question; the eval share of
    # a key space is about EVAL_FRACTION = 0.2
    share = sum(split_of("arithmetic", f"{a} + {b}") == "eval" for a in range(100) for b in range(100)) / 1e4
    assert 0.18 < share < 0.22
    assert derive_seed(1, "x") == derive_seed(1, "x") != derive_seed(2, "x")


def test_placeholders_match_media(suite: dict[str, list[Sample]]) -> None:
    expected = {"arithmetic": (0, 0), "largest": (0, 0), "shapes": (1, 0), "tones": (0, 1), "tool_lookup": (0, 0)}
    for sample in suite["train"] + suite["eval"]:
        text = "".join(m.content for m in sample.messages)
        counts = (text.count("<image>"), text.count("<audio>"))
        assert counts == expected[sample.task], sample.id
        assert (len(sample.images), len(sample.audios)) == counts
        assert all(ref.data for ref in (*sample.images, *sample.audios))
        sample.check_placeholders(sample.id)
        assert sample.modality == TASKS[sample.task].modality


def test_tool_table_never_appears_in_messages(suite: dict[str, list[Sample]]) -> None:
    for sample in (s for s in suite["train"] if s.task == "tool_lookup"):
        text = "".join(m.content for m in sample.messages)
        assert sample.metadata["key"] in text
        assert f"{sample.metadata['key']}: {sample.answer}" not in text
        assert f'"{sample.answer}"' not in text


def test_kind_names_the_question_a_sample_asks(suite: dict[str, list[Sample]]) -> None:
    from relax.data.suite import shapes, tones

    with_kinds = {name for name, spec in TASKS.items() if spec.kind is not None}
    assert with_kinds == {"shapes", "tones", "flash_beep"}  # the tasks that ask two questions about one input
    seen: dict[str, set[str]] = {"shapes": set(), "tones": set()}
    for sample in (s for s in suite["train"] if s.task in seen):
        kind = TASKS[sample.task].kind(sample)
        questions = shapes.QUESTIONS if sample.task == "shapes" else tones.QUESTIONS
        assert questions[kind] in sample.prompt_text  # the kind is the question the prompt asks
        seen[sample.task].add(kind)
    assert seen == {"shapes": {"count", "colour"}, "tones": {"count", "pitch"}}


@pytest.mark.parametrize("difficulty", DIFFICULTIES)
def test_each_kind_has_its_own_answers_and_together_they_are_the_space(difficulty: int) -> None:
    suite = generate_suite(["shapes", "tones"], seed=7, train_per_task=40, eval_per_task=20, difficulty=difficulty)
    for name in ("shapes", "tones"):
        spec = TASKS[name]
        spaces = spec.kind_answer_space(difficulty)
        assert sorted(a for space in spaces.values() for a in space) == sorted(spec.answer_space(difficulty))
        assert not set(spaces["count"]) & {a for k, space in spaces.items() if k != "count" for a in space}
        for sample in (s for s in suite["train"] + suite["eval"] if s.task == name):
            assert sample.answer in spec.answers_for(sample, difficulty)  # the question's kind holds its answer
    text = generate_suite(["largest"], seed=7, train_per_task=4, eval_per_task=2, difficulty=difficulty)["train"][0]
    assert TASKS["largest"].answers_for(text, difficulty) == TASKS["largest"].answer_space(difficulty)


@pytest.mark.parametrize("difficulty", DIFFICULTIES)
@pytest.mark.parametrize("name", ALL)
def test_random_policy_stays_below_0_3(name: str, difficulty: int) -> None:
    score = random_policy_score(TASKS[name], seed=0, n=200, difficulty=difficulty)
    assert 0.0 <= score <= 0.3


@pytest.mark.parametrize("difficulty", DIFFICULTIES)
@pytest.mark.parametrize("name", ALL)
def test_ground_truth_scores_one(name: str, difficulty: int) -> None:
    task = TASKS[name]
    for sample in task.generate(3, "train", 30, difficulty) + task.generate(3, "eval", 30, difficulty):
        assert task.reward(task.oracle_response(sample), sample) == 1.0, sample.id
        assert sample.answer in task.answer_space(difficulty), sample.id


def test_arithmetic_difficulty_knobs() -> None:
    # difficulty 1: single-digit addition only; 3: up to 99 with * allowed
    d1 = TASKS["arithmetic"].generate(0, "train", 50, 1)
    assert all(" + " in s.metadata["expression"] for s in d1)
    assert all(len(x) == 1 for s in d1 for x in s.metadata["expression"].split(" + "))
    d3 = TASKS["arithmetic"].generate(0, "train", 200, 3)
    assert {s.metadata["expression"].split()[1] for s in d3} == {"+", "-", "*"}
    assert TASKS["arithmetic"].answer_space(1) == [str(v) for v in range(2, 19)]


def test_the_whole_suite_generates_fast() -> None:
    # CPU time of this process (~0.6 s), not wall time: other work on a busy machine does not count
    start = time.process_time()
    generate_suite(ALL, seed=1, train_per_task=200, eval_per_task=50, difficulty=3)
    assert time.process_time() - start < 10.0


def test_unknown_task_names_the_closest() -> None:
    with pytest.raises(DataError, match="did you mean 'arithmetic'"):
        get_task("arithmetics")
    with pytest.raises(DataError, match="did you mean 'tool_lookup'"):
        generate_suite(["shapes", "tool-lookup"], seed=0, train_per_task=1, eval_per_task=1)


@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [
        ({"names": []}, "at least one task"),
        ({"names": ["shapes", "shapes"]}, "more than once"),
        ({"names": ["shapes"], "difficulty": 4}, "difficulty must be one of"),
        ({"names": ["shapes"], "train_per_task": -1}, "non-negative"),
    ],
)
def test_bad_suite_arguments(kwargs: dict, fragment: str) -> None:
    args = {"seed": 0, "train_per_task": 1, "eval_per_task": 1} | kwargs
    with pytest.raises(DataError, match=fragment):
        generate_suite(**args)


def test_bad_split() -> None:
    with pytest.raises(DataError, match="split must be one of"):
        TASKS["arithmetic"].generate(0, "test", 1, 1)


def test_load_reward_fn_good_paths() -> None:
    assert load_reward_fn("relax.data.verifiers:exact_match_reward") is exact_match_reward
    assert load_reward_fn("relax.data.verifiers.numeric_match_reward") is numeric_match_reward
    # a nested attribute after the colon
    assert load_reward_fn("relax.data.suite:TASKS.get") == TASKS.get


@pytest.mark.parametrize(
    ("dotted", "fragment"),
    [
        ("no_such_package_xyz.rewards:score", "cannot import module 'no_such_package_xyz.rewards'"),
        ("relax.data.verifiers:no_such_fn", "has no attribute 'no_such_fn'"),
        ("relax.data.verifiers:ANSWER_FORMAT_HINT", "is a str, not a function"),
        ("relax.data.verifiers:normalize_answer", "cannot be called as fn\\(response: str, sample: Sample\\)"),
        ("justaname", "malformed"),
        ("relax.data.verifiers:", "malformed"),
        ("relax..verifiers:fn", "malformed"),
    ],
)
def test_load_reward_fn_bad_paths(dotted: str, fragment: str) -> None:
    with pytest.raises(DataError, match=fragment):
        load_reward_fn(dotted)
