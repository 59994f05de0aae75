"""The native engine: continuous batching over a slot KV cache, on any torch device.

A scheduler thread owns the model. Each iteration it admits waiting requests while slots
are free (one prefill per prompt; the n samples of a prompt share it), then runs one
decode step for every running sequence together, then retires finished ones, so requests
join and leave the running batch at every step. Forward passes (``forward.py``) are Hugging
Face's own modules writing into ``SlotCache``, so returned logprobs equal a plain forward pass."""

from __future__ import annotations

import asyncio
import concurrent.futures
import hashlib
import logging
import threading
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from relax.engines.native import expert_routes
from relax.engines.native.forward import decode_logits, prefill_logits
from relax.engines.native.fused_decode import FusedDecoder
from relax.engines.native.kv_cache import cache_for
from relax.engines.native.media_tokens import by_video_audio, input_only_token_ids, same_media_prompts
from relax.engines.native.sampling import UniformStream, sample, top_logprobs
from relax.engines.types import Completion, EngineError, GenerateRequest
from relax.models.moe_routing import RouteRecorder

log = logging.getLogger(__name__)


@dataclass
class _Seq:
    pending: _Pending
    index: int
    slot: int
    prompt_len: int
    uniforms: UniformStream
    out_ids: list[int] = field(default_factory=list)
    out_lps: list[float] = field(default_factory=list)
    out_top: list[list[tuple[float, int]]] = field(default_factory=list)  # with top_logprobs_num > 0
    finish: dict[str, Any] | None = None
    rope_delta: int = 0  # text rope position minus cache position (multimodal 3-D rope models)
    routes: list[torch.Tensor] = field(default_factory=list)  # MoE: experts of each fed position (expert_routes.py)

    @property
    def last_pos(self) -> int:  # position of the newest token, the one the next decode step feeds in
        return self.prompt_len + len(self.out_ids) - 1


@dataclass
class _Pending:
    req: GenerateRequest
    future: concurrent.futures.Future
    listener: Any = None  # called (index, token, logprob) on the engine thread as tokens arrive
    version: str = ""
    seqs: list[_Seq] = field(default_factory=list)
    aborted: bool = False


class NativeEngine:
    def __init__(self, model: torch.nn.Module, tokenizer: Any, *, max_batch_size: int = 64,
                 max_seq_len: int | None = None, weight_version: str = "0", model_path: str = "", seed: int = 0,
                 background: bool = True, record_routes: bool = False):
        """``background``: its own scheduler thread (started on first use); False: the caller drives it.
        ``record_routes``: an MoE model's completions carry their experts (``Completion.routed_experts``)."""
        self.model = model.eval()
        self.tokenizer = tokenizer
        text = getattr(model.config, "text_config", None) or model.config
        self.max_context_length = int(max_seq_len or getattr(text, "max_position_embeddings", 2048))
        self.max_batch_size = max_batch_size
        self.cache = cache_for(model, max_batch_size, self.max_context_length)
        self.fused = FusedDecoder.maybe(model)  # lean decode step for plain text decoders
        self.banned = input_only_token_ids(model)
        self.recorder = RouteRecorder.maybe(model) if record_routes else None  # R3 (expert_routes.py)
        self.weight_version = str(weight_version)
        self.model_path = model_path
        self.seed = seed
        eos = getattr(tokenizer, "eos_token_id", None)
        self.eos_ids = {eos} if eos is not None else set()
        self._free = list(range(max_batch_size))[::-1]  # pop() hands out the lowest slot first
        self._waiting: deque[_Pending] = deque()
        self._staged: list[_Pending] = []  # generate() calls of this event-loop turn, queued together
        self._running: list[_Seq] = []
        self._inflight: dict[int, _Pending] = {}  # admitted, not yet resolved
        self._cond = threading.Condition()
        self._paused = False
        self._exclusive = threading.Lock()  # one exclusive() block at a time
        self._stop = False
        self._thread: threading.Thread | None = None
        self.background = background

    def start(self) -> NativeEngine:
        if self._thread is None:
            self._stop = False
            self._thread = threading.Thread(target=self._loop, name="relax-native-engine", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=30)
            self._thread = None

    def submit(self, req: GenerateRequest, listener: Any = None) -> concurrent.futures.Future:
        """Queue a request (future: its ``n`` completions); ``listener(index, token, logprob)`` sees each token."""
        return self._enqueue([self._pending(req, listener)])[0]

    def submit_many(self, reqs: list[GenerateRequest]) -> list[concurrent.futures.Future]:
        return self._enqueue([self._pending(r) for r in reqs])  # admitted together (see generate)

    async def generate(self, req: GenerateRequest) -> list[Completion]:
        """Requests of one event-loop turn (one HTTP batch, gathered) reach the scheduler at once: one by one,
        its batches (so padded shapes and logprobs' last bits) would depend on thread timing."""
        p = self._pending(req)
        with self._cond:
            self._staged.append(p)
            if len(self._staged) == 1:  # runs after every task already scheduled in this turn (FIFO)
                asyncio.get_running_loop().call_soon(self._release_staged)
        return await asyncio.wrap_future(p.future)

    def _release_staged(self) -> None:
        with self._cond:  # reentrant: abort() never finds a request in neither queue
            self._enqueue(self._staged)
            self._staged = []

    def _pending(self, req: GenerateRequest, listener: Any = None) -> _Pending:
        req.params.validate()
        if not req.input_ids:
            raise EngineError("input_ids is empty")
        if len(req.input_ids) >= self.max_context_length:
            raise EngineError(f"prompt has {len(req.input_ids)} tokens but the context length is "
                              f"{self.max_context_length}; shorten the prompt")
        if req.params.n > self.max_batch_size:
            raise EngineError(f"n={req.params.n} exceeds the engine's max_batch_size {self.max_batch_size}")
        return _Pending(req, concurrent.futures.Future(), listener)

    def _enqueue(self, pendings: list[_Pending]) -> list[concurrent.futures.Future]:
        with self._cond:
            self._waiting.extend(pendings)
            self._cond.notify_all()
        if self._thread is None and self.background:
            self.start()
        return [p.future for p in pendings]

    def run_forever(self) -> None:
        """Run the scheduler on the calling thread until ``stop()`` (for ``background=False``)."""
        if self.background:
            raise RuntimeError("this engine runs its own scheduler thread; build it with background=False")
        self._stop = False
        while self._step(block=True):
            pass

    def run_until_idle(self) -> None:
        """Drive the scheduler on the calling thread until every submitted request is done. For callers
        that own the compute thread (a colocated rollout, a benchmark): torch's OpenMP pool belongs to the
        thread that first used it, and a second thread doing torch work beside it measured 2x slower."""
        if self.background:
            raise RuntimeError("this engine runs its own scheduler thread; build it with background=False "
                               "to drive it with run_until_idle()")
        while self._step(block=False):
            pass

    def step(self) -> bool:
        """One scheduler iteration on the calling thread, between the caller's own checks; False when idle."""
        return self._step(block=False)

    def abort(self, rid: str) -> bool:
        """Finish request ``rid`` now (finish_reason abort); False if it is unknown or done."""
        with self._cond:
            for queued in (self._staged, self._waiting):
                p = next((p for p in queued if p.req.rid == rid), None)
                if p is not None:
                    queued.remove(p)
                    p.future.set_result([self._aborted(p, i) for i in range(p.req.params.n)])
                    return True
            for s in self._running:
                if s.pending.req.rid == rid:
                    s.pending.aborted = True
                    return True
        return False

    def update_weights(self, state_dict: dict[str, torch.Tensor] | Callable[[], None], version: str) -> None:
        """Swap weights between steps: new requests wait, running ones finish on the old weights
        (so every completion is from one version), then the new version serves. ``state_dict`` may be
        a function that writes the new weights in place (a delta, relax.transfer.weight_updates)."""
        if not callable(state_dict):
            current = self.model.state_dict()
            bad = [k for k, v in state_dict.items() if k not in current or tuple(v.shape) != tuple(current[k].shape)]
            missing = sorted(set(current) - set(state_dict))
            if bad or missing:
                raise EngineError(f"weights of version {version} do not fit this model: mismatched {bad[:3]}, "
                                  f"missing {missing[:3]}; still serving version {self.weight_version}")
        with self.exclusive():
            state_dict() if callable(state_dict) else self.model.load_state_dict(state_dict)
            if self.fused is not None:
                self.fused.refresh()  # the fused weights are copies (concatenations) of the old ones
            self.weight_version = str(version)

    @contextmanager
    def exclusive(self) -> Iterator[None]:
        """The model to the block alone (weight swap, prompt scoring): new requests wait, running ones finish first."""
        with self._exclusive:
            with self._cond:
                self._paused = True
                while self._running or self._inflight:
                    self._cond.wait(0.05)
            try:
                yield
            finally:
                with self._cond:
                    self._paused = False
                    self._cond.notify_all()

    def flush_cache(self) -> bool:
        with self._cond:
            if self._running:
                return False
            self.cache.k.zero_()
            self.cache.v.zero_()
            return True

    @property
    def load(self) -> int:
        with self._cond:
            return len(self._staged) + len(self._waiting) + len({id(s.pending) for s in self._running})

    @property
    def tokens_in_use(self) -> int:  # prompt and generated tokens the running sequences hold in the cache
        with self._cond:
            return sum(s.last_pos + 1 for s in self._running)

    def model_info(self) -> dict[str, Any]:
        text = getattr(self.model.config, "text_config", None) or self.model.config
        return {"model_path": self.model_path, "max_context_length": self.max_context_length,
                "vocab_size": text.vocab_size, "weight_version": self.weight_version, "is_generation": True,
                "max_batch_size": self.max_batch_size}

    def _loop(self) -> None:
        while self._step(block=True):
            pass

    def _step(self, block: bool = False) -> bool:
        """One scheduler pass: admit, prefill, one decode step, retire; False when stopping (or idle, non-blocking)."""
        with self._cond:
            while not self._stop and not self._running and not self._inflight \
                    and (not self._waiting or self._paused):
                if not block:
                    return False
                self._cond.wait()
            if self._stop:
                return False
            admitted = []
            while self._waiting and not self._paused and len(self._free) >= self._waiting[0].req.params.n:
                p = self._waiting.popleft()
                p.version = self.weight_version
                self._inflight[id(p)] = p
                admitted.append((p, [self._free.pop() for _ in range(p.req.params.n)]))
        try:
            with torch.no_grad():
                # one row per distinct prompt: a text request, or a media prompt's n requests
                text = [[(p, slots)] for p, slots in admitted if not p.req.mm_inputs]
                media = same_media_prompts([(p, slots) for p, slots in admitted if p.req.mm_inputs])
                for rows in (text, *by_video_audio(media)):
                    for start in range(0, len(rows), 16):  # batched prefill, bounded memory
                        self._prefill(rows[start:start + 16])
                if self._running:
                    self._decode()
        except Exception as e:  # a bug or OOM must not leave callers waiting forever
            log.exception("engine step failed")
            self._fail_all(e)
        self._retire()
        return True

    def _prefill(self, groups: list[list[tuple[_Pending, list[int]]]]) -> None:
        """Prefill prompts together (right-padded; pad positions are masked and later overwritten),
        then sample every request's first tokens. Each of ``groups`` is one prompt row: its
        requests (one, or a media prompt's n with the same ids and media) share its prefill."""
        todo, row_of = [], {}
        for group in groups:
            for p, _ in group:
                row_of[id(p)] = len(todo)
            todo.append(group[0][0])
        members = []
        for p, slots in (x for group in groups for x in group):
            req = p.req
            # a request's samples draw from their own streams: (sampling_seed or rid, index)
            base = f"seed:{req.params.sampling_seed}" if req.params.sampling_seed is not None else f"rid:{req.rid}"
            p.seqs = [_Seq(p, i, slots[i], len(req.input_ids), UniformStream(_seed_of(f"{base}:{i}", self.seed)))
                      for i in range(req.params.n)]
            if req.params.max_new_tokens == 0:
                for s in p.seqs:
                    s.finish = {"type": "length", "length": 0}
            else:
                members.append(p)
        if not members:
            return
        with expert_routes.capture(self.recorder) as captured:
            last, deltas = prefill_logits(self.model, self.fused, self.cache, [p.req.input_ids for p in todo],
                                          [p.seqs[0].slot for p in todo],
                                          [p.req.mm_inputs for p in todo] if todo[0].req.mm_inputs else None)
        prompt_routes = expert_routes.prompt_rows(captured, [len(p.req.input_ids) for p in todo])
        if deltas is not None:  # media rows: decode continues from the model's rope offset
            for p in members:
                for s in p.seqs:
                    s.rope_delta = int(deltas[row_of[id(p)]])
        rows, params, draws, seqs = [], [], [], []
        for p in members:
            i = row_of[id(p)]
            source = todo[i].seqs[0].slot
            for s in p.seqs:
                if s.slot != source:
                    self.cache.copy_slot(source, s.slot, len(todo[i].req.input_ids))
                s.routes = [prompt_routes[i]] if prompt_routes[i] is not None else []
                rows.append(i)
                params.append(p.req.params)
                draws.append(s.uniforms.next())
                seqs.append(s)
        seen = [(s.pending.req.input_ids, s.out_ids) for s in seqs]  # what the penalties count
        tokens, lps = sample(last[rows], params, draws, self.banned, seen)
        for k, (s, t, lp) in enumerate(zip(seqs, tokens, lps, strict=True)):
            self._append(s, t, lp, top_logprobs(last[rows[k]], s.pending.req.params))
        with self._cond:
            self._running.extend(s for s in seqs if s.finish is None)

    def _decode(self) -> None:
        seqs = sorted(self._running, key=lambda s: s.slot)  # consecutive slots read the cache without a copy
        with expert_routes.capture(self.recorder) as captured:
            logits = decode_logits(self.model, self.fused, self.cache, [s.out_ids[-1] for s in seqs],
                                   [s.last_pos for s in seqs], [s.slot for s in seqs], [s.rope_delta for s in seqs])
        expert_routes.add_step(seqs, captured)
        tokens, lps = sample(logits, [s.pending.req.params for s in seqs], [s.uniforms.next() for s in seqs],
                             self.banned, [(s.pending.req.input_ids, s.out_ids) for s in seqs])
        for k, (s, t, lp) in enumerate(zip(seqs, tokens, lps, strict=True)):
            self._append(s, t, lp, top_logprobs(logits[k], s.pending.req.params))

    def _append(self, s: _Seq, token: int, logprob: float, top: list[tuple[float, int]] | None = None) -> None:
        s.out_ids.append(token)
        s.out_lps.append(logprob)
        if top is not None:
            s.out_top.append(top)
        if s.pending.listener is not None:
            s.pending.listener(s.index, token, logprob)
        params = s.pending.req.params
        if token in params.stop_token_ids or (token in self.eos_ids and not params.ignore_eos):
            s.finish = {"type": "stop", "matched": token}
        elif params.stop and self.tokenizer is not None:
            tail = self.tokenizer.decode(s.out_ids[-32:])
            if (hit := next((x for x in params.stop if x in tail), None)) is not None:
                s.finish = {"type": "stop", "matched": hit}
        if s.finish is None and (len(s.out_ids) >= params.max_new_tokens
                                 or s.last_pos + 1 >= self.max_context_length):
            s.finish = {"type": "length", "length": len(s.out_ids)}

    def _retire(self) -> None:
        """Free the slots of finished requests and resolve their futures."""
        done: list[_Pending] = []
        with self._cond:
            for s in self._running:
                if s.finish is None and s.pending.aborted:
                    s.finish = {"type": "abort", "message": "aborted by request", "status_code": 200}
            self._running = [s for s in self._running if s.finish is None]
            for key, p in list(self._inflight.items()):
                if all(s.finish is not None for s in p.seqs):
                    self._free.extend(s.slot for s in p.seqs)
                    self._free.sort(reverse=True)  # keep handing out low slots: running rows stay contiguous
                    del self._inflight[key]
                    done.append(p)
            self._cond.notify_all()
        for p in done:
            p.future.set_result([Completion(p.req.rid, s.index, s.out_ids, s.out_lps, s.finish, len(p.req.input_ids),
                                            p.version, s.out_top if s.pending.req.params.top_logprobs_num else None,
                                            expert_routes.joined(s.routes))
                                 for s in p.seqs])

    def _aborted(self, p: _Pending, index: int) -> Completion:
        return Completion(p.req.rid, index, [], [], {"type": "abort", "message": "aborted by request",
                                                     "status_code": 200}, len(p.req.input_ids), self.weight_version)

    def _fail_all(self, error: Exception) -> None:
        with self._cond:
            victims = dict(self._inflight)
            self._inflight.clear()
            self._running = []
            for p in victims.values():
                self._free.extend(s.slot for s in p.seqs)
                if not p.future.done():
                    p.future.set_exception(error)
            self._cond.notify_all()


def _seed_of(rid: str, seed: int) -> int:
    return int.from_bytes(hashlib.sha256(f"{seed}:{rid}".encode()).digest()[:8], "big") >> 1
