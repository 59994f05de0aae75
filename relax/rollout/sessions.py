"""Episodes run by outside agents: sessions whose chat calls the rollout generates, recording every token.

A :class:`SessionHub` turns a batch of prompts into episode *slots* (``n`` per prompt). An agent
(through the HTTP gateway, :mod:`relax.services.api.gateway`) claims a slot by opening a session, chats
through it, may post a reward, and closes it. Token in, token out: the first call's messages are
chat-templated into the prompt; each later call repeats the recorded conversation and adds only
non-assistant messages, tokenized as an observation (masked out of the loss) as the built-in agent
loop does; the assistant's tokens and logprobs are the engine's own, never re-tokenised. A session
closed without a reward is scored by the task's verifier on its transcript.

HTTP handlers only queue work and wait on futures; :meth:`SessionHub.run_batch`, on the rollout's
thread, generates every pending turn in one ``pool.generate`` call per round (an in-process engine
runs on the calling thread), scores closed sessions and drops sessions idle past ``timeout_s``: a
dropped session leaves no trajectory and its slot is offered again, ``max_retries`` times at most.
"""

from __future__ import annotations

import dataclasses
import secrets
import threading
import time
from collections import Counter, deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from relax import liveness
from relax.data.samples import Sample
from relax.engines.types import SamplingParams
from relax.rollout.engine_pool import EnginePool
from relax.rollout.episodes import Trajectory, turn_seed
from relax.rollout.rewards import RewardDispatcher
from relax.rollout.session_requests import SessionError, checked_rewards, unusable_request
from relax.rollout.session_turns import Session, Slot, TurnMaker, TurnPlan

_COUNTS = ("sessions_opened", "sessions_closed", "sessions_dropped", "sessions_released", "session_turns")
_KEEP_ENDED = 4096  # ended sessions remembered (for 409s and GET) before the oldest are forgotten


RELEASE_LIMIT = 1000  # empty sessions on one episode before the batch gives up on it (a livelock guard)


class BatchFailed(RuntimeError):
    """The batch cannot finish: a slot was dropped past ``max_retries``, or the gateway stopped."""


@dataclass
class _Work:
    session: Session
    kind: str  # "chat" | "close"
    body: dict[str, Any]
    future: Future


class SessionHub:
    """Episode slots for one batch at a time, and the sessions agents run them in (thread-safe)."""

    def __init__(self, pool: EnginePool, tokenizer: Any, processor: Any, rewards: RewardDispatcher | None,
                 params: SamplingParams, *, max_seq_len: int, max_turns: int = 4, max_episode_tokens: int = 0,
                 tool_format: str = "qwen", done_fn: Callable[[Sample, str], bool] | None = None,
                 timeout_s: float = 60.0,
                 max_retries: int = 3, media: Callable[[Any], bytes] | None = None, gather_s: float = 0.02,
                 reward_range: tuple[float, float] = (-1.0, 1.0)):
        self.pool, self.tokenizer, self.processor, self.rewards = pool, tokenizer, processor, rewards
        self.reward_range = reward_range  # what an agent may post (rollout.agent_reward_min/max)
        self.params, self.max_seq_len, self.max_turns = params, max_seq_len, max_turns
        self.timeout_s, self.max_retries, self.gather_s = timeout_s, max_retries, gather_s
        self.media = media or (lambda ref: ref.data)
        self.turns = TurnMaker(tokenizer, processor, params, max_seq_len, max_turns, max_episode_tokens, tool_format,
                               done_fn)
        self.base_url = ""  # the gateway's URL, set by the gateway: a session's base_url lives under it
        self.counts: Counter[str] = Counter()  # sessions_opened/closed/dropped, session_turns since take_counts()
        self._cv = threading.Condition()
        self._open: deque[Slot] = deque()  # slots waiting for an agent
        self._sessions: dict[str, Session] = {}
        self._work: list[_Work] = []
        self.stopped = False  # the gateway is stopping: no new sessions, no new batch

    # -- the HTTP side (any thread) ---------------------------------------------------------------
    def open_session(self) -> tuple[str, Sample] | None:
        """Claim the next open slot: (session id, its sample); None when no slot is open."""
        with self._cv:
            if self.stopped or not self._open:
                return None
            slot = self._open.popleft()
            s = Session(secrets.token_hex(8), slot, time.monotonic())
            self._sessions[s.id] = s
            self.counts["sessions_opened"] += 1
            return s.id, slot.sample

    def chat(self, sid: str, body: dict[str, Any]) -> Future:
        """Queue one chat turn (an OpenAI chat request); the future gets :meth:`_commit`'s dict or a SessionError."""
        return self._submit(sid, "chat", body)

    def close(self, sid: str) -> Future:  # the future gets the session's final state (with its reward)
        return self._submit(sid, "close", {})

    def post_reward(self, sid: str, body: dict[str, Any]) -> dict[str, Any]:
        reward, turns = checked_rewards(body, self.reward_range)
        with self._cv:
            s = self._sessions.get(sid)
            if s is None or s.state != "open":
                what = "unknown" if s is None else s.state
                raise SessionError(409, f"session {sid} is {what}: a reward is taken only for an open session "
                                        f"(post it before /close)")
            taken = s.traj.turns if s.traj else 0
            if turns is not None and len(turns) != taken:
                raise SessionError(400, f"turn_rewards has {len(turns)} values, one per policy turn: {taken}")
            s.reward, s.turn_rewards = reward, turns
            s.last_active = time.monotonic()
            return self._describe(s)

    def describe(self, sid: str) -> dict[str, Any]:
        with self._cv:
            return self._describe(self._get(sid))

    def shutdown(self) -> None:
        with self._cv:
            self.stopped = True

    def take_counts(self) -> dict[str, int]:
        with self._cv:
            out = {k: self.counts[k] for k in _COUNTS}
            self.counts.clear()
            return out

    def _submit(self, sid: str, kind: str, body: dict[str, Any]) -> Future:
        with self._cv:
            s = self._get(sid)
            if s.state != "open":
                raise SessionError(409, f"session {sid} is {s.state}{f' ({s.why})' if s.why else ''}; "
                                        f"open a new session (POST /v1/sessions)")
            if s.busy:
                raise SessionError(409, f"session {sid} already has a request in flight; send one at a time")
            s.busy, fut = True, Future()
            self._work.append(_Work(s, kind, body, fut))
            self._cv.notify_all()
            return fut

    def _get(self, sid: str) -> Session:
        s = self._sessions.get(sid)
        if s is None:
            raise SessionError(404, f"no session {sid!r} (unknown, or ended long ago); open one with POST /v1/sessions")
        return s

    def _describe(self, s: Session) -> dict[str, Any]:
        return {"id": s.id, "state": s.state, "sample_id": s.slot.sample.id, "why": s.why,
                "turns": s.traj.turns if s.traj else 0, "tokens": len(s.traj.tokens) if s.traj else 0,
                "ended": s.traj.ended if s.traj else "",
                "reward": s.traj.reward if s.state == "closed" and s.traj else s.reward,
                "turn_rewards": s.turn_rewards, "messages": len(s.messages)}

    # -- the rollout side (the rollout's thread) -------------------------------------------------------
    def run_batch(self, prompts: list[tuple[int, Sample]], n: int,
                  midway: Callable[[], None] | None = None) -> list[Trajectory]:
        """Offer ``n`` episodes of each prompt to agents; serve their turns until every episode is closed.
        Trajectories come back in (prompt, index) order, as the built-in runner returns them. ``midway``
        runs once when half the episodes are closed (the rollout's fault point, docs/runtime.md)."""
        slots = [Slot(pos, sample, i) for pos, sample in prompts for i in range(n)]
        with self._cv:
            if self.stopped:
                raise BatchFailed("the session gateway is stopped; no agent can run this batch")
            self._open.extend(slots)
        try:
            while True:
                with self._cv:
                    if self.stopped:
                        raise BatchFailed("the session gateway stopped while this batch was running")
                    self._expire(time.monotonic())
                    closed = sum(s.done is not None for s in slots)
                    if closed == len(slots):
                        break
                if midway is not None and 2 * closed >= len(slots):
                    midway, call = None, midway
                    call()  # outside the lock: it may raise (an injected fault), which aborts the batch
                with self._cv:
                    if not self._work:
                        liveness.mark(liveness.WAITING)  # agents think at their own pace (session_timeout_s)
                        self._cv.wait(timeout=0.05)
                    self._gather()
                    work, self._work = self._work, []
                if work:
                    self._serve(work)
        except BaseException as e:
            self._abort(f"the rollout stopped this batch: {type(e).__name__}: {e}")
            raise
        with self._cv:
            self._forget_old()
        return [s.done for s in slots]  # type: ignore[misc]

    def _gather(self) -> None:
        """Wait briefly for the turns of other agents, so a round generates them together."""
        deadline = time.monotonic() + self.gather_s
        while self._work:
            waiting = sum(1 for s in self._sessions.values() if s.state == "open" and not s.busy)
            left = deadline - time.monotonic()
            if not waiting or left <= 0:
                return
            self._cv.wait(timeout=left)

    def _expire(self, now: float) -> None:
        for s in self._sessions.values():
            if s.state == "open" and not s.busy and now - s.last_active > self.timeout_s:
                self._drop(s, f"idle for more than {self.timeout_s:g} s (rollout.session_timeout_s)")

    def _drop(self, s: Session, why: str) -> None:
        """The session ends without a trajectory; its slot is offered again (or the batch fails)."""
        s.state, s.why = "dropped", why
        self.counts["sessions_dropped"] += 1
        slot = s.slot
        slot.drops += 1
        if slot.drops > self.max_retries:
            raise BatchFailed(f"episode {slot.index} of sample {slot.sample.id} (prompt position {slot.position}) "
                              f"was dropped {slot.drops} times, last: {why}; check that the agents finish their "
                              f"sessions, or raise rollout.session_max_retries / rollout.session_timeout_s")
        self._open.appendleft(slot)

    def _release(self, s: Session) -> None:
        """``s`` closed before any chat turn: an agent that looked and passed, not a failed episode, so it
        does not count against ``max_retries`` (four of them used to fail the whole batch). The slot goes
        to the back of the queue, so an agent that opens and closes in a loop cannot keep it from the
        others; only a slot released RELEASE_LIMIT times, which no working agent causes, fails the batch."""
        s.state, s.why = "closed", "closed before any chat turn"
        self.counts["sessions_released"] += 1
        slot = s.slot
        slot.releases += 1
        if slot.releases > RELEASE_LIMIT:
            raise BatchFailed(f"episode {slot.index} of sample {slot.sample.id} (prompt position {slot.position}) "
                              f"was opened and closed without a chat turn {slot.releases} times: no agent plays it; "
                              f"check what the agents do with its prompt")
        self._open.append(slot)

    def _abort(self, why: str) -> None:
        with self._cv:
            for w in self._work:
                w.future.set_exception(SessionError(503, why))
            self._work = []
            for s in self._sessions.values():
                if s.state == "open":
                    s.state, s.why = "aborted", why
            self._open.clear()

    def _forget_old(self) -> None:
        for sid in [sid for sid, s in self._sessions.items() if s.state != "open"][:-_KEEP_ENDED]:
            del self._sessions[sid]

    def _serve(self, work: list[_Work]) -> None:
        """One round: closes are scored, chat turns prepared and generated together. On a failure (the
        engine, a slot past its retries) every request of the round is answered 503 before it propagates."""
        try:
            ready: list[tuple[_Work, TurnPlan]] = []
            for w in work:
                try:
                    if w.kind == "close":
                        self._finish(w.session)
                        with self._cv:
                            state = self._describe(w.session)
                        self._resolve(w, state)
                    else:
                        ready.append((w, self.turns.plan(w.session, w.body)))
                except SessionError as e:
                    self._resolve(w, e)
                except Exception as e:  # one session's request, never the batch: nothing was recorded yet
                    if w.kind == "close":
                        raise
                    self._resolve(w, unusable_request(e))
            if not ready:
                return
            prompts = [p.context for _, p in ready]
            params = [dataclasses.replace(self.params, max_new_tokens=p.max_new, stop=[*self.params.stop, *p.stop],
                                          sampling_seed=turn_seed(p.traj, len(p.context.input_ids)))
                      for _, p in ready]
            rids = [f"{p.traj.sample.id}@{p.traj.position}:{p.traj.index}:{len(p.context.input_ids)}/{w.session.id}"
                    for w, p in ready]
            results = self.pool.generate(prompts, params, rids)
            for (w, plan), cs in zip(ready, results, strict=True):
                self._resolve(w, self.turns.record(w.session, plan, cs[0]))
                self.counts["session_turns"] += 1
        except Exception as e:
            for w in work:
                if not w.future.done():
                    self._resolve(w, SessionError(503, f"the rollout failed this batch: {type(e).__name__}: {e}"))
            raise

    def _finish(self, s: Session) -> None:
        """Close ``s``: its trajectory, scored by the posted reward or the verifier, fills the slot."""
        with self._cv:
            if s.traj is None:  # nothing was generated: nothing to train, the episode goes to another agent
                self._release(s)
                return
            s.state = "closed"
            self.counts["sessions_closed"] += 1
        t = s.traj
        t.ended = t.ended or "agent_closed"  # a limit that ended it first is kept
        t.turn_rewards = s.turn_rewards
        if t.error:  # the done hook failed on it: it trains with zero weight (trajectory_row)
            t.reward = 0.0
        elif s.reward is not None:
            t.reward = s.reward
        elif self.rewards is not None:
            scored = self.rewards.score(t.response, t.sample)
            t.reward, t.error = scored.reward, scored.error
        s.slot.done = t

    def _resolve(self, w: _Work, result: Any) -> None:
        with self._cv:
            w.session.busy = False
            w.session.last_active = time.monotonic()
        if isinstance(result, BaseException):
            w.future.set_exception(result)
        else:
            w.future.set_result(result)
