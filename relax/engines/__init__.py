"""Inference engines behind one HTTP surface (SGLang's native routes + OpenAI chat).

``native`` is a batched PyTorch engine that runs everywhere; ``sglang`` launches real
SGLang servers on GPUs. Rollout code only ever talks to a URL (``client``, ``router``).
"""
