"""Training: one training loop, with the backend that splits the model over ranks plugged in.

The loop (micro-batches, loss weights, accumulation, clipping, the optimizer step) and the actor,
critic and reference around it are ``relax.trainers.torch``; a model tells it how it is sharded
through the hooks of ``relax.trainers.model_parallel``. The backends are the PyTorch one (Hugging
Face models under DDP, no hooks: ``relax.trainers.torch``) and megatron-core
(``relax.trainers.megatron``, whose models implement the hooks). The two backend packages import
nothing of each other: what both use lives here, in ``packing`` (micro-batch layouts),
``checkpoint`` (every checkpoint format) and ``model_parallel``. The megatron package is imported
only by code that asks for that backend, so its heavy optional dependency (megatron-core) stays
optional.
"""
