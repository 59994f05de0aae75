"""Episodes: from prompts to scored token sequences, single-turn or through an ``Env``.

A :class:`Trajectory` is one sample of one prompt: its tokens (prompt, responses, and in
agent episodes the observations between them), which of those are trained (``mask``: the
policy's own tokens only), the behaviour logprobs of the trained tokens, the reward, and
the oldest weight version that produced any of its tokens (a partial rollout resumed under
new weights keeps the old version: staleness is counted from it).

Generation is batched across every trajectory of a step: each turn submits all live
trajectories at once, so the engine's continuous batching sees the whole step.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from relax.data.samples import Sample
from relax.data.suite import TASKS, Env
from relax.data.suite.base import derive_seed
from relax.engines.types import Completion, SamplingParams
from relax.models.processors import merge_media
from relax.rollout.engine_pool import EnginePool
from relax.rollout.prompts import EncodedPrompt, EncodedPromptCache, encode_prompt
from relax.rollout.rewards import RewardDispatcher

IM_END = "<|im_end|>"
# why an episode ended (Trajectory.ended, the queue's ``ended`` column; docs/agents.md)
ENDINGS = {
    "one_turn": "a single-turn task: one response",
    "env_done": "the task's environment said done (Env.step; in gateway sessions rollout.session_done_fn)",
    "agent_closed": "the external agent closed its session",
    "max_turns": "rollout.max_turns policy turns were taken",
    "max_episode_tokens": "the policy generated rollout.max_episode_tokens tokens over the episode",
    "max_seq_len": "the context reached model.max_seq_len",
    "env_error": "the environment's step raised (the episode scores 0, the error recorded)",
}


@dataclass
class Trajectory:
    sample: Sample
    position: int  # the prompt's position in the prompt stream (its group)
    index: int  # which of the prompt's n samples
    tokens: list[int]
    mask: list[int]
    logprobs: list[float]
    prompt_len: int
    mm_inputs: dict[str, torch.Tensor] | None = None
    response: str = ""
    reward: float = 0.0
    error: str = ""
    versions: list[int] = field(default_factory=list)
    turns: int = 0  # policy turns taken
    finish: str = ""
    ended: str = ""  # why the episode ended: a key of ENDINGS
    turn_spans: list[tuple[int, int]] = field(default_factory=list)  # (start, end) of each policy turn's tokens
    turn_rewards: list[float] | None = None  # one per policy turn, as an external agent posted them
    # the media bytes behind mm_inputs, in order: an HTTP engine takes bytes, not tensors
    images: list[bytes] = field(default_factory=list)
    audios: list[bytes] = field(default_factory=list)
    # MoE: the engine's (positions, layers, k) experts of the latest turn, which covers every earlier
    # token (its prefill re-read them); None for dense models (relax.engines.native.expert_routes)
    routes: Any = None

    @property
    def policy_version(self) -> int:
        return min(self.versions) if self.versions else 0

    def extend(self, c: Completion, trained: bool = True) -> None:
        self.tokens += c.output_ids
        self.mask += [1 if trained else 0] * len(c.output_ids)
        self.logprobs += list(c.logprobs) if trained else [0.0] * len(c.output_ids)
        self.versions.append(int(c.weight_version))
        if c.routed_experts is not None:
            self.routes = c.routed_experts

    @property
    def policy_tokens(self) -> int:
        """Tokens the policy generated over every turn (what rollout.max_episode_tokens bounds)."""
        return sum(self.mask)

    def observe(self, ids: list[int]) -> None:
        self.tokens += ids
        self.mask += [0] * len(ids)
        self.logprobs += [0.0] * len(ids)


# (reload new weights if any) -> called between generation rounds; returns True if it reloaded
Reloader = Callable[[], bool]


class EpisodeRunner:
    """Runs a step's prompts to scored trajectories on an engine pool."""

    def __init__(self, pool: EnginePool, tokenizer: Any, processor: Any, rewards: RewardDispatcher | None,
                 params: SamplingParams, *, max_turns: int = 4, max_seq_len: int = 256, max_episode_tokens: int = 0,
                 partial_rollout: str = "wait", media: Callable[[Any], bytes] | None = None,
                 new_weights: Callable[[], bool] | None = None, reload: Reloader | None = None):
        self.pool, self.tokenizer, self.processor = pool, tokenizer, processor
        self.rewards, self.params = rewards, params
        self.max_turns, self.max_seq_len = max_turns, max_seq_len
        self.max_episode_tokens = max_episode_tokens or 1 << 62  # 0: no limit
        self.partial_rollout = partial_rollout
        self.media = media
        self.new_weights = new_weights
        self.reload = reload
        self.aborted = 0  # partial rollouts aborted and resumed under new weights
        self.prompts = EncodedPromptCache(self._encode_uncached)  # a prompt returns every epoch

    # -- building blocks -----------------------------------------------------------------
    def encode(self, sample: Sample) -> EncodedPrompt:
        return self.prompts(sample)

    def _encode_uncached(self, sample: Sample) -> EncodedPrompt:
        load = self.media or (lambda ref: ref.data)
        return encode_prompt(sample, [load(r) for r in sample.images], [load(r) for r in sample.audios],
                             self.tokenizer, self.processor)

    def _generate(self, trajs: list[Trajectory], max_new: list[int]) -> None:
        """One generation round for ``trajs`` (n=1 each), resuming aborted partials under new weights."""
        todo = list(range(len(trajs)))
        left = list(max_new)
        while todo:
            prompts = [EncodedPrompt(trajs[i].tokens, trajs[i].mm_inputs, trajs[i].images, trajs[i].audios)
                       for i in todo]
            params = [SamplingParams(max_new_tokens=left[i], temperature=self.params.temperature,
                                     top_p=self.params.top_p, top_k=self.params.top_k, stop=self.params.stop,
                                     stop_token_ids=self.params.stop_token_ids,
                                     sampling_seed=turn_seed(trajs[i], len(trajs[i].tokens))) for i in todo]
            rids = [f"{trajs[i].sample.id}@{trajs[i].position}:{trajs[i].index}:{len(trajs[i].tokens)}" for i in todo]
            abort = self.new_weights if self.partial_rollout == "abort" else None
            results = self.pool.generate(prompts, params, rids, should_abort=abort)
            again = []
            for i, cs in zip(todo, results, strict=True):
                c = cs[0]
                trajs[i].extend(c)
                left[i] -= len(c.output_ids)
                if c.finish_reason.get("type") == "abort" and left[i] > 0:
                    again.append(i)
                else:
                    trajs[i].finish = str(c.finish_reason.get("type", ""))
            if again:
                self.aborted += len(again)
                if self.reload is not None:
                    self.reload()
            todo = again

    # -- single turn ---------------------------------------------------------------------
    def single_turn(self, prompts: list[tuple[int, Sample]], n: int) -> list[Trajectory]:
        trajs = []
        for pos, sample in prompts:
            enc = self.encode(sample)
            for i in range(n):
                trajs.append(_start(sample, pos, i, enc))
        budget = [min(self.params.max_new_tokens, self.max_seq_len - len(t.tokens), self.max_episode_tokens)
                  for t in trajs]
        self._generate(trajs, budget)
        for t in trajs:
            t.ended = "one_turn"
            t.response = self.tokenizer.decode(t.tokens[t.prompt_len:], skip_special_tokens=True)
        if self.rewards is None:  # data.reward_role: scored later, by the reward role
            for t in trajs:
                t.turns = 1
            return trajs
        for t, scored in zip(trajs, self.rewards.score_many([(t.response, t.sample) for t in trajs]), strict=True):
            t.reward, t.error, t.turns = scored.reward, scored.error, 1
        return trajs

    # -- multi-turn agent loop -----------------------------------------------------------
    def agent(self, prompts: list[tuple[int, Sample]], n: int, make_env: Callable[[Sample], Env]) -> list[Trajectory]:
        """Episodes through an Env: the policy's turns are trained, observations are masked out.

        Ends on env done, ``max_turns`` policy turns, ``max_episode_tokens`` policy tokens, or the context
        budget (``max_seq_len``); each trajectory's ``ended`` says which."""
        trajs, envs = [], []
        for pos, sample in prompts:
            enc = self.encode(sample)
            for i in range(n):
                env = make_env(sample)
                env.reset(sample)
                envs.append(env)
                trajs.append(_start(sample, pos, i, enc))
        live = list(range(len(trajs)))
        for _turn in range(self.max_turns):
            if not live:
                break
            budget = {i: min(self.params.max_new_tokens, self.max_seq_len - len(trajs[i].tokens),
                             self.max_episode_tokens - trajs[i].policy_tokens) for i in live}
            for i in live:
                if budget[i] <= 0:
                    trajs[i].ended = "max_seq_len"
            live = [i for i in live if budget[i] > 0]
            start = {i: len(trajs[i].tokens) for i in live}
            self._generate([trajs[i] for i in live], [budget[i] for i in live])
            nxt = []
            for i in live:
                t = trajs[i]
                text = self.tokenizer.decode(t.tokens[start[i]:], skip_special_tokens=True)
                t.response += text
                t.turns += 1
                try:
                    obs, reward, done, _info = envs[i].step(text)
                except Exception as e:  # a faulty env scores this episode 0 with the error recorded
                    t.error = f"env step failed on sample {t.sample.id}: {type(e).__name__}: {e}"
                    t.ended = "env_error"
                    continue
                t.reward = float(reward)
                if done:
                    t.ended = "env_done"
                    continue
                if t.policy_tokens >= self.max_episode_tokens:
                    t.ended = "max_episode_tokens"
                    continue
                t.ended = "max_turns"  # unless a later turn ends it otherwise
                ids, mm, images, audios = self.observation(t, obs)
                if len(t.tokens) + len(ids) >= self.max_seq_len:
                    t.finish, t.ended = "token_budget", "max_seq_len"
                    continue
                t.observe(ids)
                t.response += f"\n[tool] {obs}\n"
                if mm:
                    t.mm_inputs = merge_media(t.mm_inputs, mm)
                    t.images, t.audios = t.images + images, t.audios + audios
                nxt.append(i)
            live = nxt
        return trajs

    def observation(self, t: Trajectory, obs: Any) -> tuple[list[int], dict[str, torch.Tensor] | None,
                                                             list[bytes], list[bytes]]:
        """Tokens of a tool turn (``obs`` is text, or ``{"content": text-with-placeholders,
        "images": [bytes], "audios": [bytes]}``), closing the policy's turn if it did not."""
        if isinstance(obs, dict):
            content, images, audios = obs.get("content", ""), obs.get("images", []), obs.get("audios", [])
        else:
            content, images, audios = str(obs), [], []
        enc = observation_tokens(t.tokens, [{"role": "tool", "content": content}], images, audios,
                                 self.tokenizer, self.processor)
        return enc.input_ids, enc.mm_inputs, enc.images, enc.audios


def observation_tokens(tokens: list[int], messages: list[dict[str, str]], images: list[bytes], audios: list[bytes],
                       tokenizer: Any, processor: Any) -> EncodedPrompt:
    """The tokens that follow a policy turn ending in ``tokens``: the turn's end if the policy did not
    close it, then ``messages`` (tool results, a user's reply) and the next generation prompt. The agent
    loop and the session gateway (relax.rollout.sessions) both append observations this way."""
    closed = tokens and tokens[-1] == tokenizer.convert_tokens_to_ids(IM_END)
    turn = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    text = ("" if closed else IM_END) + "\n" + turn
    return encode_prompt(text, images, audios, tokenizer, processor)


def default_env_factory(max_turns: int) -> Callable[[Sample], Env] | None:
    """Env constructor by the sample's task (tasks without one are single-turn)."""
    def make(sample: Sample) -> Env:
        task = TASKS[sample.task]
        try:
            return task.make_env(max_turns=max_turns)
        except TypeError:
            return task.make_env()
    return make


def needs_env(sample: Sample) -> bool:
    task = TASKS.get(sample.task)
    return task is not None and task.make_env is not None


def _start(sample: Sample, position: int, index: int, enc: EncodedPrompt) -> Trajectory:
    """A trajectory holding only its (untrained) prompt."""
    n = len(enc.input_ids)
    return Trajectory(sample, position, index, list(enc.input_ids), [0] * n, [0.0] * n, n, enc.mm_inputs,
                      images=list(enc.images), audios=list(enc.audios))


def turn_seed(t: Trajectory, length: int) -> int:
    # the sampling stream of a turn depends on the prompt, the sample index and how far it got:
    # the same run replays the same tokens, and a resumed partial does not repeat its first draws
    return derive_seed(t.sample.id, t.position, t.index, length) >> 1
