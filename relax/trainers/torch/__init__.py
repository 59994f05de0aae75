"""The PyTorch training backend: actor, critic and reference on Hugging Face models.

Micro-batches are planned by ``packing`` (padding-free packing with block-diagonal
attention, length buckets, or plain padding), logprobs come from ``forward``, the RL loss
from ``relax.algorithms``, and state (model, optimizer, schedule, RNG) is saved and
restored bit-exactly by ``checkpoint``.
"""
