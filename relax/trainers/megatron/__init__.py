"""Megatron-core training backend: model building and HF <-> Megatron weight conversion.

``convert`` is pure tensor bookkeeping and imports no megatron code, so the rollout side
(which only needs HF-layout weights) and CPU-only tests can use it without megatron-core.
``model`` imports megatron-core (the ``megatron`` extra, 0.16.x) and builds a ``GPTModel``
from a Hugging Face config. See docs/megatron.md for the parameter layout.
"""
