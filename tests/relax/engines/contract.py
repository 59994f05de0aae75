"""The engine HTTP contract, runnable against ANY engine URL (native server or SGLang).

``run_contract(url)`` drives the server only through :class:`EngineClient`, so it checks the
wire format the rollout side relies on, not an implementation. Helpers below build a tiny
local model folder and start servers (subprocess or in-process uvicorn) on loopback.
"""

from __future__ import annotations

import asyncio
import base64
import os
import socket
import subprocess
import sys
import threading
import urllib.request
from pathlib import Path
from typing import Any

from relax.engines.client import EngineClient, EngineHTTPError
from tests.media_files import png_bytes, wav_bytes  # noqa: F401 - the engine tests' media
from tests.polling import wait_until

REPO = Path(__file__).resolve().parents[3]
CORPUS = ["hello world", "the quick brown fox jumps over the lazy dog", "1 + 2 = 3", "<answer>42</answer>",
          "what is the colour of the sky? blue", "a red square and a blue circle"] * 4


def save_tiny_model(folder: Path, seed: int = 0, max_positions: int = 64) -> Path:
    """A 2-layer Qwen2 with a locally trained byte-level BPE (chat template included), saved as an HF folder."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from relax.models.tokenizers import train_bpe_tokenizer

    tok = train_bpe_tokenizer(CORPUS, vocab_size=300)
    cfg = Qwen2Config(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_positions,
                      eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(cfg).eval()
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


def auth(extra: dict[str, str] | None = None) -> dict[str, str]:
    """Headers with the engines' bearer token (tests/conftest.py sets RELAX_ENGINE_TOKEN)."""
    return {"Authorization": f"Bearer {os.environ['RELAX_ENGINE_TOKEN']}", **(extra or {})}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(url: str, timeout_s: float = 90.0, proc: subprocess.Popen | None = None) -> None:
    def healthy() -> bool:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode} before becoming healthy")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                return r.status == 200
        except OSError:
            return False

    wait_until(healthy, timeout_s, interval=0.2, what=f"{url} healthy")


def start_subprocess(args: list[str], port: int, log: Path) -> tuple[subprocess.Popen, str]:
    """``python <args>`` with cwd=repo; returns (process, url) once /health is 200."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "OMP_NUM_THREADS": "1"}
    with open(log, "wb") as fh:
        proc = subprocess.Popen([sys.executable, *args], cwd=REPO, env=env, stdout=fh, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc=proc)
    except Exception:
        proc.kill()
        raise RuntimeError(f"server {args} failed to start; log:\n{log.read_text()[-3000:]}") from None
    return proc, url


class InProcessServer:
    """A uvicorn server on a thread (loopback, free port) for an app built in this process."""

    def __init__(self, app: Any):
        import uvicorn

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> InProcessServer:
        self.thread.start()
        wait_healthy(self.url, timeout_s=30)
        return self

    def __exit__(self, *exc: Any) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)


def data_uri(blob: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(blob).decode()}"


async def _expect_400(coro: Any, *needles: str) -> str:
    try:
        await coro
    except EngineHTTPError as e:
        assert e.status == 400, f"expected 400, got {e.status}: {e.message}"
        for n in needles:
            assert n in e.message, f"{n!r} not in error message {e.message!r}"
        return e.message
    raise AssertionError("expected HTTP 400, the request succeeded")


async def check_contract(url: str) -> dict[str, Any]:
    """Every check of the contract; returns a few facts for the caller to extend on."""
    async with EngineClient(url, timeout_s=60, retries=0) as c:
        assert await c.health()
        info = await c.model_info()
        assert {"model_path", "weight_version"} <= set(info), info
        version = str(info["weight_version"])
        greedy = {"temperature": 0.0, "max_new_tokens": 8, "ignore_eos": True}

        r = await c.generate(input_ids=[5, 6, 7], sampling_params=greedy, return_logprob=True)
        assert isinstance(r, dict) and isinstance(r["text"], str)
        ids, meta = r["output_ids"], r["meta_info"]
        assert len(ids) == 8 and meta["completion_tokens"] == 8 and meta["prompt_tokens"] == 3
        assert meta["finish_reason"]["type"] == "length" and str(meta["weight_version"]) == version
        assert meta["e2e_latency"] >= 0 and meta["id"]
        lps = meta["output_token_logprobs"]
        assert len(lps) == 8 and all(len(t) == 3 and t[0] <= 0 and t[1] == i for t, i in zip(lps, ids, strict=True))
        again = await c.generate(input_ids=[5, 6, 7], sampling_params=greedy)
        assert again["output_ids"] == ids, "greedy decoding must be deterministic"
        assert "output_token_logprobs" not in again["meta_info"]

        t = await c.generate(text="hello world", sampling_params={**greedy, "max_new_tokens": 4})
        assert len(t["output_ids"]) == 4 and t["meta_info"]["prompt_tokens"] > 0
        batch = await c.generate(text=["hello", "the quick brown fox"], sampling_params={"max_new_tokens": 3})
        assert isinstance(batch, list) and len(batch) == 2 and all(len(b["output_ids"]) <= 3 for b in batch)

        many = await c.generate(input_ids=[5, 6, 7], sampling_params={"n": 3, "max_new_tokens": 4, "ignore_eos": True})
        assert isinstance(many, list) and len(many) == 3 and all(len(m["output_ids"]) == 4 for m in many)

        one = await c.generate(input_ids=[5, 6, 7], sampling_params={**greedy, "max_new_tokens": 1})
        assert len(one["output_ids"]) == 1 and one["meta_info"]["finish_reason"]["type"] == "length"

        stop_id = ids[2]
        s = await c.generate(input_ids=[5, 6, 7], sampling_params={**greedy, "stop_token_ids": [stop_id]})
        fr = s["meta_info"]["finish_reason"]
        assert fr["type"] == "stop" and fr["matched"] == stop_id and stop_id in s["output_ids"], s
        assert len(s["output_ids"]) <= 3

        full = (await c.generate(input_ids=[5, 6, 7], sampling_params=greedy))["text"]
        stop = next((full[i:i + 2] for i in range(len(full) - 1) if full[i:i + 2].strip()), None)
        if stop:  # a tiny random model can emit only whitespace; then there is nothing to stop on
            s = await c.generate(input_ids=[5, 6, 7], sampling_params={**greedy, "stop": [stop]})
            assert s["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}, s
            assert stop not in s["text"] and full.startswith(s["text"])

        await c.abort("no-such-request-id")

        await _expect_400(c.generate(input_ids=[5], sampling_params={"top_p": 0.0}), "top_p")
        await _expect_400(c.generate(input_ids=[5], sampling_params={"top_k": 0}), "top_k")
        await _expect_400(c.generate(input_ids=[5], sampling_params={"temperature": -1}), "temperature")
        limit = int(info.get("max_context_length") or 1 << 20)
        await _expect_400(c.generate(input_ids=[5] * (limit + 3)), str(limit + 3), str(limit))
        await _expect_400(c.generate(text="look: <image>", image_data=["data:image/png;base64,@@not-b64@@"]),
                          "image_data[0]")

        bad = await c.update_weights_from_disk("/nonexistent/runs/r/weights/00000099", version="99")
        assert bad["success"] is False and bad["message"], bad
        after = await c.generate(input_ids=[5, 6, 7], sampling_params=greedy)
        assert after["output_ids"] == ids and str(after["meta_info"]["weight_version"]) == version
        assert str((await c.model_info())["weight_version"]) == version
        return {"info": info, "greedy_ids": ids}


def run_contract(url: str) -> dict[str, Any]:
    """Synchronous entry point: ``run_contract("http://127.0.0.1:30000")``."""
    return asyncio.run(check_contract(url))
