"""SGLang's native wire format, translated for an in-process engine.

:class:`Frontend` turns ``/generate`` bodies (text or already-expanded ids, per-prompt
``sampling_params``, rids, base64 media) into ``GenerateRequest``s and the engine's
``Completion``s back into SGLang's ``{"text", "output_ids", "meta_info"}`` replies (shapes of
SGLang 0.5.x, docs/engines.md); ``update_weights_from_disk`` loads new weights into the engine.
The HTTP routes around it are in ``server.py``; OpenAI chat in ``openai_routes.py``.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import functools
import time
import uuid
from typing import Any

from relax.engines.adapter_load import load_into
from relax.engines.native.scoring import PromptScores, score_prompt
from relax.engines.streaming import stream_response
from relax.engines.types import (
    Completion,
    EngineError,
    GenerateRequest,
    SamplingParams,
    refuse_unless_neutral,
    routes_to_wire,
)
from relax.engines.weight_source import check_source, complete_tied, load_weights, store_version
from relax.faults import fault_point
from relax.transfer.adapter_versions import is_adapter_chain
from relax.transfer.weight_updates import WeightFollower


def decode_media(item: Any, kind: str, index: int) -> bytes:
    """``data:<mime>;base64,<b64>`` or bare base64 -> bytes; anything else is a 400 naming the item."""
    if not isinstance(item, str) or not item:
        raise EngineError(f"{kind}[{index}] must be a non-empty data: URI or base64 string")
    payload = item
    if item.startswith("data:"):
        head, sep, payload = item.partition(",")
        if not sep or not head.endswith(";base64"):
            raise EngineError(f"{kind}[{index}] is a data: URI without ';base64,' data")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise EngineError(f"{kind}[{index}] is not valid base64 (URLs and paths are not fetched)") from None


def validate_media(images: list[bytes], audios: list[bytes]) -> None:
    """Decode every item once, so a corrupt PNG/WAV is a 400 naming it rather than a crash later."""
    import io
    import wave

    from PIL import Image

    for i, b in enumerate(images):
        try:  # PIL raises many exception types
            Image.open(io.BytesIO(b)).verify()
        except Exception as e:
            raise EngineError(f"image_data[{i}] is not a decodable image: {e}") from None
    for i, b in enumerate(audios):
        try:
            with wave.open(io.BytesIO(b)) as w:
                w.getnframes()
        except Exception as e:
            raise EngineError(f"audio_data[{i}] is not a decodable WAV file: {e}") from None


# /generate fields beside sampling_params that the native engine does not serve (hidden states, embeddings,
# video, LoRA): only their defaults pass. Prompt logprobs (logprob_start_len) are served for scoring alone.
UNSERVED = {"return_hidden_states": (None, False), "input_embeds": (None,),
            "routed_experts_start_len": (None, 0),
            "video_data": (None, []), "lora_path": (None,), "custom_logit_processor": (None,)}


def _as_list(x: Any) -> list[Any]:
    return [] if x is None else list(x) if isinstance(x, list) else [x]


class Frontend:
    """Turns wire requests into ``GenerateRequest``s and ``Completion``s back into wire responses."""

    def __init__(self, engine: Any, model_path: str, processor: Any = None):
        self.engine = engine
        self.model_path = model_path
        self.processor = processor  # relax.models.processors.MediaProcessor or None (text-only)
        self.inflight: set[str] = set()
        self.follower = WeightFollower()  # what the engine's weights are, for deltas (weight_updates)

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    def tokenize(self, text: str, images: list[bytes], audios: list[bytes]) -> tuple[list[int], dict | None]:
        validate_media(images, audios)
        if not images and not audios:
            return list(self.tokenizer.encode(text, add_special_tokens=False)), None
        if self.processor is None:
            kinds = " and ".join(k for k, v in (("images", images), ("audio", audios)) if v)
            raise EngineError(f"this model takes no {kinds}; serve a multimodal model to send media")
        from relax.models.processors import prepare_inputs

        try:
            inputs = prepare_inputs(text, images, audios, self.tokenizer, self.processor)
        except ValueError as e:
            raise EngineError(str(e)) from None
        ids = inputs.pop("input_ids")[0].tolist()
        inputs.pop("attention_mask", None)
        return ids, inputs

    def media_for_ids(self, ids: list[int], images: list[bytes], audios: list[bytes]) -> dict:
        """Media tensors for ``input_ids`` that already hold the expanded media tokens (how the
        rollout sends a prompt it tokenized itself, or one that grew over agent turns)."""
        validate_media(images, audios)
        if self.processor is None:
            raise EngineError("this model takes no images or audio; serve a multimodal model to send media")
        from relax.models.processors import check_expanded, media_features

        try:
            mm, image_counts, audio_counts = media_features(images, audios, self.processor)
            check_expanded(ids, image_counts, audio_counts, self.processor)
        except ValueError as e:
            raise EngineError(str(e)) from None
        return mm

    def check_length(self, n: int, params: SamplingParams | None = None, explicit: bool = False) -> None:
        """The prompt fits the context; an explicit ``max_new_tokens`` must fit beside it (a 400 naming the
        limit, as SGLang answers), a default one is cut to the room left."""
        limit = int(self.engine.max_context_length)
        if n == 0:
            raise EngineError("the prompt is empty (input_ids=[])")
        if n >= limit:
            raise EngineError(f"The input ({n} tokens) is longer than the model's context length ({limit} tokens).")
        if params is None:
            return
        if explicit and n + params.max_new_tokens > limit:
            raise EngineError(f"max_new_tokens={params.max_new_tokens} with a {n}-token prompt exceeds the model's "
                              f"context length ({limit} tokens); ask for at most {limit - n}")
        params.max_new_tokens = min(params.max_new_tokens, limit - n)

    def check_ids(self, ids: list[Any], where: str = "input_ids") -> None:
        """Token ids are integers inside the vocabulary: checked before the request joins a batch, so a
        bad id fails its own request (400) and not the prefill of every request batched with it."""
        vocab = self.vocab_size
        for i, t in enumerate(ids):
            if isinstance(t, bool) or not isinstance(t, int) or t < 0 or (vocab is not None and t >= vocab):
                raise EngineError(f"{where}[{i}] = {t!r} is not a token id of this model (0 <= id < {vocab})")

    @functools.cached_property
    def vocab_size(self) -> int | None:  # read once: a weight update never changes the vocabulary
        info = getattr(self.engine, "model_info", None)
        return info().get("vocab_size") if callable(info) else None

    async def run(self, req: GenerateRequest) -> list[Completion]:
        self.inflight.add(req.rid)
        try:
            return await self.engine.generate(req)
        finally:
            self.inflight.discard(req.rid)

    def text(self, ids: list[int], params: SamplingParams | None = None) -> str:
        """``ids`` as text, under ``params``' ``skip_special_tokens`` and ``spaces_between_special_tokens``
        (both go to the tokenizer, as SGLang passes them); None: the OpenAI routes' decoding (skipped)."""
        if params is None or (params.skip_special_tokens and params.spaces_between_special_tokens):
            return self.tokenizer.decode(ids, skip_special_tokens=True)
        return self.tokenizer.decode(ids, skip_special_tokens=params.skip_special_tokens,
                                     spaces_between_special_tokens=params.spaces_between_special_tokens)

    def decode(self, ids: list[int], finish: dict[str, Any], trim: bool, params: SamplingParams | None = None) -> str:
        text = self.text(ids, params)
        matched = finish.get("matched") if finish else None
        if trim and isinstance(matched, str) and matched in text:
            text = text[: text.index(matched)]
        return text

    def entry(self, logprob: float | None, token: int, with_text: bool) -> list[Any]:
        """SGLang's logprob triple ``[logprob, id, text|null]`` (a null logprob at position 0 of a prompt)."""
        return [None if logprob is None else float(logprob), int(token),
                self.tokenizer.decode([token]) if with_text else None]

    def to_native(self, c: Completion, n: int, t0: float, opts: dict[str, Any],
                  params: SamplingParams | None = None) -> dict[str, Any]:
        meta: dict[str, Any] = {
            "id": c.rid if n == 1 else f"{c.rid}-{c.index}", "finish_reason": c.finish_reason,
            "prompt_tokens": c.prompt_tokens, "completion_tokens": len(c.output_ids), "cached_tokens": 0,
            "weight_version": c.weight_version, "e2e_latency": time.perf_counter() - t0}
        if opts.get("return_logprob"):
            with_text = bool(opts.get("return_text_in_logprobs"))
            meta["output_token_logprobs"] = [self.entry(lp, t, with_text)
                                             for lp, t in zip(c.logprobs, c.output_ids, strict=False)]
            if c.top_logprobs is not None:
                meta["output_top_logprobs"] = [
                    [self.entry(lp, t, with_text) for lp, t in row] for row in c.top_logprobs
                ]
        if opts.get("return_routed_experts") and c.routed_experts is not None:  # SGLang's: int32, base64
            meta["routed_experts"] = routes_to_wire(c.routed_experts)
        trim = not opts.get("no_stop_trim", False)
        return {"text": self.decode(c.output_ids, c.finish_reason, trim, params), "output_ids": list(c.output_ids),
                "meta_info": meta}

    async def generate(self, body: dict[str, Any]) -> Any:
        """SGLang ``/generate``: a dict for one prompt with n=1, a list for a batch or n>1."""
        t0 = time.perf_counter()
        refuse_unless_neutral(body, UNSERVED)
        if body.get("return_routed_experts") and getattr(self.engine, "recorder", None) is None:
            raise EngineError("return_routed_experts: this server records no routed experts; serve an MoE model "
                              "with --enable-return-routed-experts")
        text, ids = body.get("text"), body.get("input_ids")
        if (text is None) == (ids is None):
            raise EngineError("send exactly one of 'text' or 'input_ids'")
        batched = isinstance(text, list) or (isinstance(ids, list) and ids and isinstance(ids[0], list))
        prompts = (text if isinstance(text, list) else [text]) if text is not None else (ids if batched else [ids])
        b = len(prompts)
        if b == 0:
            raise EngineError("the batch is empty: send at least one prompt")
        sps = body.get("sampling_params") or {}
        sps = sps if isinstance(sps, list) else [sps] * b
        rids = body.get("rid") or [uuid.uuid4().hex for _ in range(b)]
        rids = rids if isinstance(rids, list) else [rids]
        if len(sps) != b or len(rids) != b or len(set(rids)) != b:
            raise EngineError(f"sampling_params and rid must have one (unique) entry per prompt ({b})")
        media = {}
        for kind in ("image_data", "audio_data"):
            items = body.get(kind)
            per = [_as_list(items)] if not batched else [_as_list(x) for x in _as_list(items)]
            if batched and items is not None and len(per) != b:
                raise EngineError(f"{kind} has {len(per)} entries for a batch of {b}")
            media[kind] = per if items is not None else [[] for _ in range(b)]
        top = body.get("top_logprobs_num")  # SGLang takes it beside sampling_params, for every prompt
        reqs = []
        for i, p in enumerate(prompts):
            params = SamplingParams.from_json(sps[i] if top is None else {**(sps[i] or {}), "top_logprobs_num": top})
            imgs = [decode_media(x, "image_data", j) for j, x in enumerate(media["image_data"][i])]
            auds = [decode_media(x, "audio_data", j) for j, x in enumerate(media["audio_data"][i])]
            if isinstance(p, str):  # tokenizing a long prompt must not stall the event loop (and /health)
                pid, mm = await asyncio.to_thread(self.tokenize, p, imgs, auds)
            elif isinstance(p, list):
                self.check_ids(p, "input_ids" if not batched else f"input_ids[{i}]")
                pid = list(p)
                mm = await asyncio.to_thread(self.media_for_ids, pid, imgs, auds) if imgs or auds else None
            else:
                raise EngineError(
                    "text must be a string or a list of strings; input_ids a list of ints or of such lists"
                )
            self.check_ids(params.stop_token_ids, "sampling_params.stop_token_ids")
            self.check_length(len(pid), params, explicit=isinstance(sps[i], dict) and
                              sps[i].get("max_new_tokens") is not None)
            reqs.append(GenerateRequest(rid=str(rids[i]), input_ids=pid, params=params, mm_inputs=mm))
        start = body.get("logprob_start_len")
        scoring = start is not None and start != -1
        if scoring and all(r.params.max_new_tokens == 0 for r in reqs):
            return await self.score(reqs, start, body, t0, batched)
        if scoring:
            self._check_scoring(reqs, start, body, generating=True)
        if body.get("stream"):
            if len(reqs) != 1:
                raise EngineError("stream=true takes one prompt (n may be > 1); send a batch without stream")
            return stream_response(self, reqs[0], t0, body)
        results = await asyncio.gather(*(self.run(r) for r in reqs))
        # SGLang takes no_stop_trim inside sampling_params; the body level is kept for older callers
        opts = [
            {
                **body,
                "no_stop_trim": bool(body.get("no_stop_trim") or (isinstance(sp, dict) and sp.get("no_stop_trim"))),
            }
            for sp in sps
        ]
        replies = [[self.to_native(c, r.params.n, t0, opts[i], r.params) for c in cs]
                   for i, (r, cs) in enumerate(zip(reqs, results, strict=True))]
        if scoring:  # prompt log-probs beside the generated ones, on the same weights
            await self.generate_scored(reqs, start, body, replies)
        out = [row for rows in replies for row in rows]
        return out if batched or len(out) > 1 else out[0]

    async def score(self, reqs: list[GenerateRequest], start: Any, body: dict[str, Any], t0: float,
                    batched: bool) -> Any:
        """``logprob_start_len`` >= 0 with ``max_new_tokens`` 0: each prompt's ``input_token_logprobs`` (and
        ``input_top_logprobs``) from that position on, as SGLang answers (``native/scoring.py``)."""
        self._check_scoring(reqs, start, body, generating=False)
        out = []
        for r in reqs:
            scores, version = await self._prompt_scores(r, start)
            meta: dict[str, Any] = {
                "id": r.rid, "finish_reason": {"type": "length", "length": 0}, "prompt_tokens": len(r.input_ids),
                "completion_tokens": 0, "cached_tokens": 0, "weight_version": version,
                "e2e_latency": time.perf_counter() - t0, "output_token_logprobs": [],
                **self._input_logprobs(r, start, scores, body)}
            if scores.top is not None:
                meta["output_top_logprobs"] = []
            out.append({"text": "", "output_ids": [], "meta_info": meta})
        return out if batched else out[0]

    async def generate_scored(self, reqs: list[GenerateRequest], start: Any, body: dict[str, Any],
                              replies: list[list[dict[str, Any]]]) -> None:
        """``logprob_start_len`` >= 0 with generation: add each prompt's input log-probs (from ``start``) to
        its samples' replies (``replies[i]``: prompt i's), as SGLang serves prompt and output log-probs
        in one ``/generate``. The prompt is scored on the weights its samples were generated with: a
        weight swap in between is scored again."""
        for r, rows in zip(reqs, replies, strict=True):
            want = {str(row["meta_info"]["weight_version"]) for row in rows}
            for _ in range(2):
                scores, version = await self._prompt_scores(r, start)
                if want == {version}:
                    break
            else:
                raise EngineError(f"the weights changed while request {r.rid} generated (versions {sorted(want)}); "
                                  f"send it again", status=503)
            for row in rows:
                row["meta_info"].update(self._input_logprobs(r, start, scores, body))

    def _check_scoring(self, reqs: list[GenerateRequest], start: Any, body: dict[str, Any], generating: bool) -> None:
        if isinstance(start, bool) or not isinstance(start, int) or start < 0:
            raise EngineError(f"logprob_start_len must be -1 or a position >= 0, not {start!r}")
        if not body.get("return_logprob") or body.get("stream"):
            raise EngineError("logprob_start_len asks for prompt log-probs: send return_logprob=true, without stream")
        if not generating and any(r.params.n != 1 for r in reqs):
            raise EngineError("scoring a prompt (max_new_tokens=0) takes n=1")
        if getattr(self.engine, "exclusive", None) is None:
            raise EngineError("this engine does not score prompts (logprob_start_len)")
        for i, r in enumerate(reqs):
            if start >= len(r.input_ids):
                raise EngineError(f"logprob_start_len={start} is not below prompt {i}'s length ({len(r.input_ids)})")

    async def _prompt_scores(self, r: GenerateRequest, start: int) -> tuple[PromptScores, str]:
        def run() -> tuple[PromptScores, str]:
            with self.engine.exclusive():
                return score_prompt(self.engine.model, r.input_ids, start, r.params.top_logprobs_num,
                                    r.mm_inputs), str(self.engine.weight_version)

        return await asyncio.to_thread(run)

    def _input_logprobs(self, r: GenerateRequest, start: int, scores: PromptScores,
                        body: dict[str, Any]) -> dict[str, Any]:
        with_text = bool(body.get("return_text_in_logprobs"))
        ids = r.input_ids[start:]
        out: dict[str, Any] = {"input_token_logprobs": [self.entry(lp, t, with_text)
                                                        for lp, t in zip(scores.logprobs, ids, strict=True)]}
        if scores.top is not None:
            out["input_top_logprobs"] = [None if row is None else [self.entry(lp, t, with_text) for lp, t in row]
                                         for row in scores.top]
        return out

    async def update_weights_from_disk(self, body: dict[str, Any], store_root: str | None,
                                       run_id: str | None) -> tuple[int, dict[str, Any]]:
        path = body.get("model_path")
        if not isinstance(path, str) or not path:
            return 400, {"success": False, "message": "model_path must be a non-empty string", "num_paused_requests": 0}
        try:
            check_source(path, store_root, run_id, self.model_path)
        except PermissionError as e:
            return 403, {"success": False, "message": str(e), "num_paused_requests": 0}
        try:
            found = store_version(path, store_root, run_id)
            # deltas where they are fewer bytes; an adapter version goes below, merged onto its base
            follows = found is not None and hasattr(self.engine, "model")
            chain = await asyncio.to_thread(found[0].chain, found[1]) if follows else None
            if chain is not None and hasattr(self.engine, "model") and not is_adapter_chain(chain):
                await self._follow(found[0], found[1], body.get("weight_version"), path, chain)
                return 200, {"success": True, "message": f"loaded {path} as weight_version {found[1]} "
                                                         f"({self.follower.last_path})", "num_paused_requests": 0}
            state, version = await asyncio.to_thread(load_weights, path, store_root, run_id)
            fault_point("engine", "load", int(version) if version.isdigit() else None)
            label = body.get("weight_version")
            # the version the samples will carry is the store's, never a label the caller chose
            if label is not None and str(label) != version:
                raise EngineError(f"weight_version {label!r} is not the version at {path!r} ({version})")
            await asyncio.to_thread(load_into, self.engine, state, version)  # an adapter merged onto its base
            self.follower.forget()
        except Exception as e:  # the engine keeps its old weights; the caller decides what to do
            return 400, {"success": False, "message": f"{type(e).__name__}: {e}", "num_paused_requests": 0}
        return 200, {"success": True, "message": f"loaded {path} as weight_version {version}",
                     "num_paused_requests": 0}

    async def _follow(self, store: Any, version: int, label: Any, path: str, chain: list[dict[str, Any]]) -> None:
        """A WeightStore version through the engine's :class:`WeightFollower`."""
        fault_point("engine", "load", version)
        if label is not None and str(label) != str(version):  # samples carry the store's version, not a label
            raise EngineError(f"weight_version {label!r} is not the version at {path!r} ({version})")
        if str(self.engine.weight_version) != str(self.follower.version):  # changed another way (a broadcast)
            self.follower.forget()
        model = self.engine.model
        await asyncio.to_thread(self.follower.update, store, version, model.state_dict, self.engine.update_weights,
                                lambda s: self.engine.update_weights(complete_tied(s, model), str(version)), chain)
