"""What a task is: a seeded sample generator, a reward function and, for agentic tasks, an env.

Built-in tasks are synthetic and verifiable, so an RL run can be smoke-tested end to end
(text, image, audio, tool use) without downloading data, and a run that does not beat
:func:`random_policy_score` is visibly broken.

Determinism rules every generator follows:

* randomness comes only from :func:`split_rng`, seeded with sha256 of (seed, task, split,
  difficulty settings) -- never ``hash()`` (salted per process) nor global RNG state;
* whether a question belongs to train or eval is a fixed function of its content
  (:func:`split_of`), independent of the seed, so no seed's train set ever contains
  another seed's eval questions.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib
import inspect
import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar, runtime_checkable

from relax.data.errors import DataError
from relax.data.samples import Sample

RewardFn = Callable[[str, Sample], float]
"""A reward function: ``def reward(response: str, sample: Sample) -> float``.

This is the public extension point for scoring. ``response`` is the policy's full
generated text for ``sample`` (reasoning included; use
:func:`relax.data.verifiers.extract_final_answer` to get at the answer). ``sample`` is the
:class:`~relax.data.samples.Sample` it answered, with ``sample.answer`` the ground truth and
``sample.metadata`` any extra JSON the task or dataset stored for grading.

The function must return a float in ``[0, 1]`` (1 = fully correct), must be pure and
deterministic (it may run in parallel worker processes, in any order, several times for
the same response) and should be fast (it runs once per rollout). Select a custom one by
dotted path, e.g. ``"my_pkg.rewards:strict_json"``; see :func:`load_reward_fn`.
"""

SPLITS = ("train", "eval")
#: Share of every task's question space reserved for evaluation.
EVAL_FRACTION = 0.2

T = TypeVar("T")


@runtime_checkable
class Env(Protocol):
    """A multi-turn environment for agentic tasks, driven by the rollout loop.

    ``reset(sample)`` starts an episode and returns the first observation (the rollout shows
    the policy the sample's own prompt). ``step(action_text)`` takes the policy's next message
    and returns ``(observation, reward, done, info)``: what to show the policy next (e.g. a
    tool result), the reward of the episode so far in ``[0, 1]`` (the last one counts), whether
    the episode ended, and JSON-serialisable diagnostics. An observation is text, or
    ``{"content": text with <image>/<audio> placeholders, "images": [PNG/JPEG bytes],
    "audios": [WAV bytes]}`` for a multimodal model; it enters the context as a ``tool`` turn
    and is never trained on.
    """

    def reset(self, sample: Sample) -> str: ...

    def step(self, action_text: str) -> tuple[str, float, bool, dict[str, Any]]: ...


@dataclass(frozen=True)
class TaskSpec:
    """A registered task.

    ``generate(seed, split, n, difficulty)`` returns ``n`` samples for ``split`` ("train" or
    "eval"), the same ones for the same arguments. ``answer_space(difficulty)`` lists every
    answer the task can have at that difficulty; the random-policy baseline guesses from
    it. ``make_env`` builds a fresh :class:`Env` for tasks that need several turns; for
    those, ``reward`` scores a single-shot transcript and the agent loop uses the env.
    ``oracle`` writes a response that earns full reward (for SFT warm-up and self-checks);
    by default it is ``<answer>{sample.answer}</answer>``. ``kind``, for a task that asks
    several kinds of question about one input (count or colour of the same picture), names a
    sample's kind: evaluation reports accuracy per kind, because a policy can learn one kind
    and stay at chance on the other while the task's mean looks half-way there.
    ``ordinal_kinds`` lists the kinds whose answers are ordered integers (counts): there an
    answer one away from the truth may earn ``algorithm.near_miss_credit`` during training.
    ``kind_answer_space(difficulty)`` maps each kind to the answers a question of that kind
    can have (the question says which kind it is, so this tells nothing about the answer).
    """

    name: str
    modality: str
    description: str
    generate: Callable[[int, str, int, int], list[Sample]]
    reward: RewardFn
    answer_space: Callable[[int], list[str]]
    make_env: Callable[[], Env] | None = None
    difficulties: tuple[int, ...] = (1, 2, 3)
    oracle: Callable[[Sample], str] | None = None
    kind: Callable[[Sample], str] | None = None
    ordinal_kinds: tuple[str, ...] = ()
    kind_answer_space: Callable[[int], Mapping[str, list[str]]] | None = None

    def __post_init__(self) -> None:
        if self.modality not in ("text", "image", "audio", "video"):
            raise DataError(
                f"task {self.name!r}: modality must be text, image, audio or video, not {self.modality!r}"
            )

    def is_ordinal(self, sample: Sample) -> bool:
        """Whether ``sample`` asks a question of one of :attr:`ordinal_kinds`."""
        return self.kind is not None and self.kind(sample) in self.ordinal_kinds

    def oracle_response(self, sample: Sample) -> str:
        """A response to ``sample`` that ``reward`` scores 1.0."""
        if self.oracle is not None:
            return self.oracle(sample)
        return f"<answer>{sample.answer}</answer>"

    def answers_for(self, sample: Sample, difficulty: int) -> list[str]:
        """Every answer ``sample``'s question can have: its kind's answers where the task names
        kinds (``kind_answer_space``), else the whole answer space."""
        if self.kind is not None and self.kind_answer_space is not None:
            return list(self.kind_answer_space(difficulty)[self.kind(sample)])
        return list(self.answer_space(difficulty))

    def response_with(self, sample: Sample, answer: str) -> str:
        """The oracle response to ``sample`` written for ``answer`` instead of the true one: the
        format warm-start's demonstrations and the rollout's forced answers."""
        return self.oracle_response(dataclasses.replace(sample, answer=answer))


def question_kind(sample: Sample) -> str:
    """``sample.metadata["question"]``: the ``kind`` of the built-in tasks that ask several questions."""
    return str(sample.metadata["question"])


def derive_seed(*parts: object) -> int:
    """A 64-bit seed from ``parts``, stable across processes, platforms and Python versions."""
    digest = hashlib.sha256("\x1f".join(repr(p) for p in parts).encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big")


def split_rng(seed: int, task: str, split: str, config: object) -> random.Random:
    """The one random stream a task draws ``split`` from; sample i depends on samples < i only.

    ``config`` is the task's frozen settings dataclass; its ``repr`` enters the seed, so
    every distinct setting (e.g. image size) gets its own stream.
    """
    return random.Random(derive_seed(seed, task, split, repr(config)))


def split_of(task: str, key: str) -> str:
    """``"eval"`` for a fixed :data:`EVAL_FRACTION` of question keys, ``"train"`` for the rest."""
    bucket = int.from_bytes(hashlib.sha256(f"{task}\x1f{key}".encode()).digest()[:4], "big")
    return "eval" if bucket < EVAL_FRACTION * 2**32 else "train"


def sample_id(task: str, split: str, index: int) -> str:
    """Stable id such as ``arithmetic-train-000012``."""
    return f"{task}-{split}-{index:06d}"


def check_generate_args(
    task: str, split: str, n: int, difficulty: int, difficulties: tuple[int, ...]
) -> None:
    """Reject bad ``generate`` arguments with a message saying what is allowed."""
    if split not in SPLITS:
        raise DataError(f"task {task!r}: split must be one of {SPLITS}, not {split!r}")
    if not isinstance(n, int) or n < 0:
        raise DataError(f"task {task!r}: the number of samples must be a non-negative integer, not {n!r}")
    if difficulty not in difficulties:
        raise DataError(f"task {task!r}: difficulty must be one of {difficulties}, not {difficulty!r}")


def draw_for_split(
    rng: random.Random,
    task: str,
    split: str,
    draw: Callable[[random.Random], T],
    key: Callable[[T], str],
    seen: set[str],
    max_draws: int = 20_000,
    fresh_tries: int = 64,
    want: Callable[[T], bool] | None = None,
) -> T:
    """Draw questions until one belongs to ``split`` (and satisfies ``want``, when given),
    preferring ones not in ``seen``.

    Small question spaces (single-digit addition) run out of fresh questions; after
    ``fresh_tries`` repeats a seen one is accepted, so generation never stalls.
    """
    repeat: T | None = None
    repeats = 0
    for _ in range(max_draws):
        item = draw(rng)
        if want is not None and not want(item):
            continue
        item_key = key(item)
        if split_of(task, item_key) != split:
            continue
        if item_key not in seen:
            seen.add(item_key)
            return item
        repeat, repeats = item, repeats + 1
        if repeats >= fresh_tries:
            return repeat
    if repeat is not None:
        return repeat
    raise DataError(
        f"task {task!r}: found no {split} question in {max_draws} draws; the question space is too "
        f"small for a train/eval split, widen the task's difficulty settings"
    )


def generate_split(
    task: str,
    seed: int,
    split: str,
    n: int,
    config: object,
    draw: Callable[[random.Random], T],
    key: Callable[[T], str],
    to_sample: Callable[[T, str], Sample],
    label: Callable[[T], tuple[str, str]] | None = None,
    classes: Mapping[str, Sequence[str]] | None = None,
) -> list[Sample]:
    """The loop every generator shares: ``n`` fresh questions of ``split`` from the task's one
    random stream, each turned into a sample with a stable id by ``to_sample(item, id)``.

    With ``label`` (an item's ``(kind, answer)``) and ``classes`` (every answer of each kind),
    the split is balanced: sample ``i`` is drawn until its label is :func:`balanced_label`
    ``(classes, i)``, so kinds alternate and each kind's answers come in turn. Why: RL on a
    skewed split learns the commonest answer first (for a policy blind to the input, the
    expected policy gradient of answer ``k``'s logit is ``p_k (q_k - sum_c q_c p_c)``, with
    ``q`` the answers' frequencies: zero only when ``q`` is uniform), and a policy that
    answers it every time gets no signal back from groups that are all right or all wrong."""
    rng = split_rng(seed, task, split, config)
    seen: set[str] = set()
    out = []
    for i in range(n):
        want = None
        if label is not None and classes is not None:
            target = balanced_label(classes, i)
            want = lambda item, target=target: label(item) == target  # noqa: E731
        out.append(to_sample(draw_for_split(rng, task, split, draw, key, seen, want=want), sample_id(task, split, i)))
    return out


def balanced_label(classes: Mapping[str, Sequence[str]], i: int) -> tuple[str, str]:
    """The ``(kind, answer)`` of sample ``i`` of a balanced split: kinds in sorted order take
    turns, and within a kind its answers take turns (``classes = {"count": ["1", "2"],
    "colour": ["red"]}`` gives colour/red, count/1, colour/red, count/2, ...)."""
    kinds = sorted(classes)
    kind = kinds[i % len(kinds)]
    answers = classes[kind]
    return kind, answers[(i // len(kinds)) % len(answers)]


def random_policy_score(task: TaskSpec, seed: int, n: int, difficulty: int) -> float:
    """Mean reward on ``n`` eval samples when every response is a uniform guess from the answer space.

    The floor a trained policy must clear. For tool tasks the guess is given without a
    tool call, which the task's reward scores as 0.
    """
    if n <= 0:
        raise DataError(f"random_policy_score needs n >= 1 samples, got {n}")
    samples = task.generate(seed, "eval", n, difficulty)
    space = task.answer_space(difficulty)
    if not space:
        raise DataError(f"task {task.name!r}: answer_space({difficulty}) is empty")
    rng = random.Random(derive_seed(seed, task.name, "random-policy", difficulty))
    return sum(task.reward(rng.choice(space), s) for s in samples) / len(samples)


def _split_dotted(dotted: str, what: str) -> tuple[str, str]:
    if ":" in dotted:
        module, _, attr = dotted.partition(":")
    else:
        module, _, attr = dotted.rpartition(".")
    if (
        not module
        or not attr
        or not all(part.isidentifier() for part in (*module.split("."), *attr.split(".")))
    ):
        raise DataError(
            f"{what} path {dotted!r} is malformed; write it as 'package.module:function' "
            f"(or 'package.module.function')"
        )
    return module, attr


def load_function(dotted: str, what: str, args: tuple[Any, ...], usage: str) -> Callable[..., Any]:
    """Import the function named by ``"pkg.mod:fn"`` or ``"pkg.mod.fn"`` (an extension point).

    The module must be importable in every worker (installed, or on ``PYTHONPATH``). The
    function is checked to accept ``args`` (placeholders of its documented parameters);
    ``what`` and ``usage`` ("fn(response: str, sample: Sample) -> float") name it in errors.
    """
    module_name, attr_path = _split_dotted(dotted.strip(), what)
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        raise DataError(
            f"{what} {dotted!r}: cannot import module {module_name!r} ({e}); check the spelling "
            f"and that its package is installed or on PYTHONPATH"
        ) from None
    except Exception as e:  # the user's module raised while importing
        raise DataError(f"{what} {dotted!r}: importing {module_name!r} failed: {type(e).__name__}: {e}") from e
    target: Any = module
    for part in attr_path.split("."):
        if not hasattr(target, part):
            raise DataError(
                f"{what} {dotted!r}: {module_name!r} has no attribute {attr_path!r}; "
                f"define '{usage.replace('fn(', f'def {part}(', 1)}' there or fix the name"
            )
        target = getattr(target, part)
    if not callable(target):
        raise DataError(f"{what} {dotted!r} is a {type(target).__name__}, not a function; it must be "
                        f"callable as {usage}")
    try:
        inspect.signature(target).bind(*args)
    except TypeError:
        raise DataError(
            f"{what} {dotted!r} cannot be called as {usage.split(' ->')[0]}; its signature is "
            f"{inspect.signature(target)}"
        ) from None
    except ValueError:  # builtins without a signature: trust them
        pass
    return target


def load_reward_fn(dotted: str) -> RewardFn:
    """The :data:`RewardFn` named by ``dotted``; its return value is checked by the caller (``[0, 1]``)."""
    return load_function(dotted, "reward function", ("response", None), "fn(response: str, sample: Sample) -> float")


def load_env_fn(dotted: str) -> Callable[[Sample], Env]:
    """An env factory ``make_env(sample) -> Env`` named by ``dotted`` (``rollout.env_fn``): called
    once per episode, so each gets a fresh :class:`Env`."""
    return load_function(dotted, "env factory", (None,), "fn(sample: Sample) -> Env")
