"""The training loop, and the PyTorch backend: actor, critic and reference on Hugging Face models.

``trainer.TorchTrainer`` is the one loop both backends train through: a Hugging Face model (DDP
over the data-parallel ranks, ``trainer.wrap_ddp``) or a megatron-core model that tells the loop
how it is sharded (``relax.trainers.model_parallel``). Micro-batches are planned by
``relax.trainers.packing`` (padding-free packing with block-diagonal attention, length buckets, or
plain padding), logprobs come from ``forward``, the RL loss from ``relax.algorithms``, and state
(model, optimizer, schedule, RNG) is saved and restored bit-exactly by ``relax.trainers.checkpoint``.
"""
