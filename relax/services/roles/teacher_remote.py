"""A teacher behind an engine URL (``teacher.url``): the student's rows scored as prompt log-probs.

Each row (prompt and sampled response, already token ids) goes to the server's SGLang ``/generate``
with ``max_new_tokens = 0``, ``return_logprob``, ``logprob_start_len = 1`` and, with
``algorithm.distill_topk`` = k, ``top_logprobs_num = k``. The answer's ``input_token_logprobs`` (and
``input_top_logprobs``) are the teacher's log-probabilities of each token given the tokens before it:
the columns the in-process teacher commits (position 0, which nothing predicts, is 0; the top-k
columns are kept from the first trained token on). Relax's engine server and SGLang both answer
it, at temperature 1 (``relax.engines.native.scoring``; the config refuses another rollout temperature).

Nothing the server answers is trusted: every position must be present, name the token the row
holds, and carry a finite log-probability <= 0, or the step fails naming the row (and the role's
supervisor retries it) instead of committing a wrong column.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import math
import os
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from relax.config.preflight import TEACHER_KEY_ENV, served_vocab_size
from relax.engines.client import EngineBadResponse, EngineClient
from relax.services.queue_contract import topk_response_start
from relax.transfer.consumer import Batch

CONCURRENCY = 16  # rows in flight to the server at once


def run_async(coro: Any) -> Any:
    """``coro``'s result, from a thread of its own when the caller already runs an event loop (a Serve replica)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, coro).result()


class RemoteTeacher:
    """``columns(batch)`` -> the teacher role's columns for a batch of rows, from the server at ``url``."""

    def __init__(self, url: str, topk: int = 0, timeout_s: float = 600.0):
        self.url, self.topk, self.timeout_s = url, topk, timeout_s
        # the teacher's own credential, if any: the run's engine token controls the run's engines and is
        # never sent to a server the user named (EngineClient would default to it)
        self.token = os.environ.get(TEACHER_KEY_ENV) or ""

    def vocab_size(self) -> int | None:
        """The served model's vocabulary (``/get_model_info``), or None when the server does not say."""
        return served_vocab_size(self.url)

    def columns(self, batch: Batch) -> dict[str, list[torch.Tensor]]:
        """``teacher_logprobs`` (L,) per row and, with top-k, ``teacher_topk_ids`` /
        ``teacher_topk_logprobs`` (L, k)."""
        scored = run_async(self._all(batch.ids, batch.fields["tokens"], batch.fields["loss_mask"]))
        out: dict[str, list[torch.Tensor]] = {"teacher_logprobs": [s[0] for s in scored]}
        if self.topk:
            out["teacher_topk_ids"] = [s[1] for s in scored]
            out["teacher_topk_logprobs"] = [s[2] for s in scored]
        return out

    async def _all(self, ids: Sequence[str], tokens: Sequence[Any], masks: Sequence[Any]) -> list[tuple]:
        gate = asyncio.Semaphore(CONCURRENCY)
        async with EngineClient(self.url, timeout_s=self.timeout_s, token=self.token) as client:
            async def one(sid: str, row: Any, mask: Any) -> tuple:
                async with gate:
                    nothing_trained = topk_response_start(mask) >= len(row)
                    return await self._row(client, sid, [int(t) for t in row], len(row) if nothing_trained else 1)
            return await asyncio.gather(*(one(*x) for x in zip(ids, tokens, masks, strict=True)))

    async def _row(self, client: EngineClient, sid: str, row: list[int], start: int) -> tuple:
        k, n = self.topk, len(row)
        lps, top_ids, top_lps = torch.zeros(n), torch.zeros(n, k, dtype=torch.long), torch.zeros(n, k)
        if start >= n:  # nothing trained in this row
            return lps, top_ids, top_lps
        extra = {"logprob_start_len": start, **({"top_logprobs_num": k} if k else {})}
        reply = await client.generate(row, sampling_params={"max_new_tokens": 0}, return_logprob=True, **extra)
        meta = reply.get("meta_info", {}) if isinstance(reply, dict) else {}
        entries = meta.get("input_token_logprobs")
        if not isinstance(entries, list) or len(entries) != n - start:
            raise self._bad(sid, f"{len(entries) if isinstance(entries, list) else 'no'} input_token_logprobs for "
                                 f"positions {start}..{n - 1}")
        for j, entry in enumerate(entries, start):
            lps[j] = self._logprob(sid, j, entry, row[j])
        if k:
            rows = meta.get("input_top_logprobs")
            if not isinstance(rows, list) or len(rows) != n - start:
                raise self._bad(sid, "no input_top_logprobs for every scored position")
            for j, top in enumerate(rows, start):
                if not isinstance(top, list) or len(top) != k:
                    raise self._bad(sid, f"position {j}: {str(top)[:80]!r} is not {k} [logprob, id, text] entries")
                for c, entry in enumerate(top):
                    top_lps[j, c] = self._logprob(sid, j, entry, None)
                    top_ids[j, c] = int(entry[1])
        return lps, top_ids, top_lps

    def _logprob(self, sid: str, pos: int, entry: Any, token: int | None) -> float:
        ok = (isinstance(entry, (list, tuple)) and len(entry) >= 2 and isinstance(entry[0], (int, float))
              and not isinstance(entry[1], bool) and isinstance(entry[1], int))
        if not ok or not math.isfinite(entry[0]) or entry[0] > 1e-4 or (token is not None and entry[1] != token):
            want = f"token {token}" if token is not None else "a token id"
            raise self._bad(sid, f"position {pos}: {str(entry)[:80]!r} is not [finite logprob <= 0, {want}, ...]")
        return float(np.float32(entry[0]))

    def _bad(self, sid: str, why: str) -> EngineBadResponse:
        return EngineBadResponse(f"teacher {self.url} scored row {sid!r} wrongly ({why}); check that it serves the "
                                 f"teacher with the student's tokenizer and answers logprob_start_len")
