"""The rollout role: prompts -> engines -> rewards -> the ``rollouts`` topic.

One ``step()`` commits one batch (``prompts_per_step`` complete prompt groups). Before it
generates batch k it waits until

* the queue has room: committed-but-untrained samples + this batch <= (max_staleness+1) * batch
  (``wait_for_capacity`` against the actor's consumer group), and
* the WeightStore holds a policy version >= k - max_staleness, which it loads first: the
  newest one, or with ``queue.exact_staleness`` version k - max_staleness itself, so that the
  version behind each batch does not depend on timing and a run repeats exactly.

So batch k is trained at actor version k by samples at most ``max_staleness`` versions old;
``max_staleness = 0`` is synchronous on-policy training. Where to continue (prompt position,
batch index) is stored in the meta of each commit, so a restarted rollout resumes exactly.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from relax.algorithms.turn_rewards import turn_reward_tokens
from relax.config import ConfigError
from relax.data.suite import load_env_fn
from relax.data.suite.base import load_function
from relax.engines.types import SamplingParams
from relax.faults import fault_point
from relax.models.builders import policy_config
from relax.models.moe_routing import config_route_shape
from relax.rollout.episodes import EpisodeRunner, Trajectory, default_env_factory, needs_env
from relax.rollout.prompts import PromptStream
from relax.rollout.rewards import RewardDispatcher, reward_metrics
from relax.rollout.sessions import SessionHub
from relax.rollout.tool_calls import tool_format
from relax.services.api.elastic import ElasticRollout
from relax.services.api.gateway import Gateway, GatewayStartError
from relax.services.queue_contract import ACTOR_GROUP, rollout_fields, routes_column, routes_field
from relax.services.roles.media import pack_media
from relax.services.rollout_engines import RolloutEngines, check_api_port, open_engines
from relax.services.run_context import RunContext
from relax.transfer.consumer import GroupView, wait_for_capacity


def trajectory_row(t: Trajectory, group_size: int, scored: bool = True, turn_rewards: bool = False) -> dict[str, Any]:
    """A queue row; a sample whose reward failed keeps its tokens but trains with zero weight.
    ``scored=False`` (data.reward_role): no reward or error yet, the reward role adds them.
    ``turn_rewards`` (algorithm.turn_reward_coef): each token's posted turn reward too."""
    mask = np.asarray(t.mask, dtype=np.int8)
    if t.error:
        mask[:] = 0
    row = {"id": f"{t.sample.id}@{t.position}.{t.index}", "group": f"p{t.position}", "group_size": group_size,
            "policy_version": t.policy_version, "tokens": np.asarray(t.tokens, dtype=np.int64), "loss_mask": mask,
            "logprobs": np.asarray(t.logprobs, dtype=np.float32), "reward": np.float32(t.reward),
            "prompt_len": np.int32(t.prompt_len), "task": t.sample.task, "response": t.response, "error": t.error,
            "ended": t.ended,
            # the prompt's media come back from the snapshot; those of later turns only from here
            "turn_media": pack_media(t.images[len(t.sample.images):], t.audios[len(t.sample.audios):])}
    if turn_rewards:
        row["turn_rewards"] = turn_reward_tokens(len(t.tokens), t.turn_spans, t.turn_rewards or [])
    if not scored:
        del row["reward"], row["error"]
    return row


def _groups(trajs: list[Trajectory], prompts: list) -> list[list[Trajectory]]:
    """Trajectories grouped by prompt, in the prompts' order."""
    groups: dict[int, list[Trajectory]] = {}
    for t in trajs:
        groups.setdefault(t.position, []).append(t)
    return [groups[pos] for pos, _ in prompts]


class RolloutRole:
    """Owns the engines (in-process, engine processes it starts, or URLs behind the router) and
    the rollout producer. HTTP engines are supervised (docs/runtime.md, "Engine faults")."""

    def __init__(self, ctx: RunContext, engine_urls: list[str] | None = None, writer_id: str = "rollout",
                 api_mode: str = "thread"):
        """``api_mode`` (with ``rollout.api_port``): 'thread' serves the REST API from this process
        (uvicorn on a thread); 'ingress' only builds ``self.elastic`` for Ray Serve's ingress."""
        cfg = ctx.cfg
        self.ctx, self.cfg = ctx, cfg
        # before the producer or any engine starts: a run that cannot serve its API fails at once
        check_api_port(cfg, engine_urls, check_port=api_mode == "thread")
        self.queue = ctx.queue()
        self.scores = not cfg.data.reward_role  # else the reward role does (relax.services.roles.reward)
        self.turn_rewards = cfg.algorithm.turn_reward_coef > 0
        fields = rollout_fields(not self.scores, self.turn_rewards)
        self.route_shape = None  # algorithm.routing_replay: the engine's experts travel with each row (R3)
        if cfg.algorithm.routing_replay:
            self.route_shape = config_route_shape(policy_config(cfg.model, ctx.tokenizer))
            fields += (routes_field(*self.route_shape),)
        self.producer = self.queue.producer(writer_id, fields, tokens_field="tokens")
        self.store = ctx.weights()
        self.actor_view = GroupView(self.queue, ACTOR_GROUP)  # incremental: read new cursor records only
        meta = self.producer.last_meta() or {}
        self.batch = int(meta.get("batch", -1)) + 1  # the next batch index
        self.stream = PromptStream(ctx.split("train"), seed=cfg.seed, position=int(meta.get("next_prompt", 0)))
        self.api_mode = api_mode
        try:
            self._start(engine_urls)
        except BaseException:
            self.producer.close()  # a role that failed to start holds no writer lease
            raise

    def _start(self, engine_urls: list[str] | None) -> None:
        """The engines, the episode runner and (``rollout.api_port``) the REST API on the pool."""
        ctx, cfg, r = self.ctx, self.cfg, self.cfg.rollout
        tok = ctx.tokenizer
        self.engines: RolloutEngines = open_engines(ctx, engine_urls, self.store)
        self.pool, processor = self.engines.pool, self.engines.processor
        self.rewards = RewardDispatcher.for_training(cfg) if self.scores else None
        params = SamplingParams(max_new_tokens=r.max_new_tokens, temperature=r.temperature, top_p=r.top_p,
                                top_k=r.top_k, stop=list(r.stop))
        self.runner = EpisodeRunner(self.pool, tok, processor, self.rewards, params, max_turns=r.max_turns,
                                    max_episode_tokens=r.max_episode_tokens,
                                    max_seq_len=cfg.model.max_seq_len, partial_rollout=r.partial_rollout,
                                    media=ctx.snapshot.load_media, new_weights=self._newer_weights,
                                    reload=self.sync_weights)
        # a custom env (rollout.env_fn) drives every sample; otherwise tasks with an env use it
        self.make_env = load_env_fn(r.env_fn) if r.env_fn else default_env_factory(r.max_turns)
        self.needs_env = (lambda _sample: True) if r.env_fn else needs_env
        self.hub, self.gateway = None, None
        if r.agents == "external":  # outside programs run every episode through the gateway (docs/agents.md)
            self.hub = SessionHub(self.pool, tok, processor, self.rewards, params, max_seq_len=cfg.model.max_seq_len,
                                  max_turns=r.max_turns, max_episode_tokens=r.max_episode_tokens,
                                  tool_format=tool_format(r.tool_format, cfg.model.family),
                                  done_fn=load_function(r.session_done_fn, "session done hook", (None, ""),
                                                        "fn(sample: Sample, response: str) -> bool")
                                  if r.session_done_fn else None,
                                  timeout_s=r.session_timeout_s,
                                  max_retries=r.session_max_retries, media=ctx.snapshot.load_media,
                                  reward_range=(r.agent_reward_min, r.agent_reward_max))
            try:
                self.gateway = Gateway(self.hub, r.gateway_host, r.gateway_port, run_url=ctx.run_url,
                                       media=ctx.snapshot.load_media).start()
            except GatewayStartError as e:  # the port: a setting to change
                self.engines.close()
                raise ConfigError(str(e)) from None
            except BaseException:
                self.engines.close()
                raise
        try:
            self.engines.start_api(cfg, self.store, self.api_mode)
        except BaseException:
            if self.gateway is not None:
                self.gateway.stop()
            self.engines.close()  # stops the engine processes started above
            raise

    @property
    def elastic(self) -> ElasticRollout | None:
        """The elastic API's operations for Ray Serve's ingress (``api_mode='ingress'``), once built."""
        return self.engines.elastic

    # -- weights ------------------------------------------------------------------------------
    def _newer_weights(self) -> bool:
        latest = self.store.latest()
        return latest is not None and latest > self.pool.weight_version

    def sync_weights(self, latest: int | None = None) -> bool:
        """Load the newest published version (``latest`` if the caller just looked it up) if the
        engines lag it; True if they loaded one."""
        latest = self.store.latest() if latest is None else latest
        if latest is None or latest <= self.pool.weight_version:
            return False
        self.pool.load_weights(self.store, latest)
        return True

    def _exact_version(self, wanted: int) -> int:
        """``wanted`` if the store still holds it (always, but after a resume that skipped ahead:
        the actor keeps the newest max_staleness + 1 versions); else the oldest newer one."""
        versions = [v for v in self.store.versions() if v >= wanted]
        return wanted if wanted in versions else versions[0]

    # -- one batch ------------------------------------------------------------------------------
    def step(self, timeout: float | None = None) -> dict[str, Any]:
        cfg, r = self.cfg, self.cfg.rollout
        t0 = time.perf_counter()
        wait_for_capacity(self.queue, ACTOR_GROUP, self.ctx.batch_size, cfg.queue.max_staleness,
                          incoming=self.ctx.batch_size, timeout=timeout, view=self.actor_view)
        oldest = max(0, self.batch - cfg.queue.max_staleness)
        latest = self.store.wait_for(oldest, timeout)
        t_wait = time.perf_counter()
        self.sync_weights(self._exact_version(oldest) if cfg.queue.exact_staleness else latest)
        kept: list[list[Trajectory]] = []
        filtered = generated = 0
        while len(kept) < r.prompts_per_step:
            prompts = self.stream.take(r.prompts_per_step - len(kept))
            for group in self._run(prompts):
                generated += 1
                rewards = [t.reward for t in group]
                if r.dynamic_sampling and max(rewards) == min(rewards):
                    filtered += 1  # DAPO: a group with equal rewards has zero advantage everywhere
                    continue
                kept.append(group)
            if generated >= 8 * r.prompts_per_step and len(kept) < r.prompts_per_step:
                break  # dynamic sampling found too few informative groups; ship what there is
        rows = [trajectory_row(t, r.n_samples_per_prompt, self.scores, self.turn_rewards) for g in kept for t in g]
        if cfg.algorithm.routing_replay:
            for row, t in zip(rows, (t for g in kept for t in g), strict=True):
                row["routed_experts"] = routes_column(t.routes, len(t.tokens), row["id"], self.route_shape)
        self.producer.put(rows, meta={"next_prompt": self.stream.position, "batch": self.batch})
        self.batch += 1
        trajs = [t for g in kept for t in g]
        elapsed = time.perf_counter() - t0
        metrics = {"role": "rollout", "batch": self.batch - 1, "weight_version": self.pool.weight_version,
                   "newest_version": latest,  # published when the batch began: above weight_version = skipped
                   "reward": float(np.mean([t.reward for t in trajs])) if trajs else 0.0,
                   "response_tokens": float(np.mean([sum(t.mask) for t in trajs])) if trajs else 0.0,
                   "turns": float(np.mean([t.turns for t in trajs])) if trajs else 0.0,
                   "samples": len(rows), "filtered_groups": filtered,
                   "reward_errors": sum(bool(t.error) for t in trajs),
                   "aborted_partials": self.runner.aborted, "wait_s": t_wait - t0, "time_s": elapsed,
                   "samples_per_s": len(rows) / max(elapsed, 1e-9), "epoch": self.stream.epoch}
        metrics.update(self.engines.fault_counts())  # engine retries, unhealthy marks, replacements
        if self.hub is not None:  # sessions opened, closed, dropped (timed out, agent died) and their turns
            metrics.update(self.hub.take_counts())
        if not self.scores:  # the reward role reports them (merged by batch in the run's report)
            for key in ("reward", "reward_errors"):
                metrics.pop(key)
            return metrics
        metrics.update(reward_metrics([(t.sample, t.reward) for t in trajs]))
        return metrics

    def _run(self, prompts: list) -> list[list[Trajectory]]:
        n = self.cfg.rollout.n_samples_per_prompt
        if self.hub is not None:  # sessions are opened only here, so weights never change under one
            midway = lambda: fault_point("rollout", "midway", self.batch)  # noqa: E731
            return _groups(self.hub.run_batch(prompts, n, midway), prompts)
        single = [p for p in prompts if not self.needs_env(p[1])]
        multi = [p for p in prompts if self.needs_env(p[1])]
        trajs = self.runner.single_turn(single, n) if single else []
        if multi:
            trajs += self.runner.agent(multi, n, self.make_env)
        return _groups(trajs, prompts)

    def close(self) -> None:
        if self.gateway is not None:
            self.gateway.stop()
        self.engines.stop_api()
        self.producer.close()
        self.engines.close()  # stops the engine processes the pool owns
