"""A tied-embedding model (small Qwen2.5, Qwen3, Llama-3.2) reloads from its own save_pretrained folder, which
holds no lm_head.weight: it used to answer 400 "missing ['lm_head.weight']"."""

from __future__ import annotations

import asyncio
from pathlib import Path

from relax.engines.client import EngineClient
from relax.engines.server import build_native_engine, create_app
from tests.relax.engines.contract import CORPUS, InProcessServer


def save_tied_model(folder: Path) -> Path:
    import torch
    from safetensors.torch import load_file
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from relax.models.tokenizers import train_bpe_tokenizer

    tok = train_bpe_tokenizer(CORPUS, vocab_size=300)
    cfg = Qwen2Config(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, tie_word_embeddings=True)
    torch.manual_seed(0)
    Qwen2ForCausalLM(cfg).eval().save_pretrained(folder)
    tok.save_pretrained(folder)
    assert "lm_head.weight" not in load_file(str(folder / "model.safetensors"))  # what makes it a test
    return folder


def test_a_tied_model_reloads_from_its_own_folder(tmp_path):
    model_dir = save_tied_model(tmp_path / "tied")
    engine, processor = build_native_engine(str(model_dir), max_batch_size=4)
    engine.start()
    greedy = {"temperature": 0.0, "max_new_tokens": 4, "ignore_eos": True}

    async def go(url: str) -> None:
        async with EngineClient(url, timeout_s=60, retries=0) as c:
            before = (await c.generate(input_ids=[5, 6, 7], sampling_params=greedy))["output_ids"]
            r = await c.update_weights_from_disk(str(model_dir))
            assert r["success"] is True, r
            after = await c.generate(input_ids=[5, 6, 7], sampling_params=greedy)
            assert after["output_ids"] == before and after["meta_info"]["weight_version"] == "tied"

    try:
        with InProcessServer(create_app(engine, str(model_dir), processor=processor)) as srv:
            asyncio.run(go(srv.url))
    finally:
        engine.stop()
