"""Every checkpoint format of the trainers, shared by both backends.

* ``files``: the files of a checkpoint read without trusting them (``meta.json`` last, sha256, a
  weights-only load).
* ``trainer_state``: the whole-file ``trainer.pt`` (model, optimizer, LR schedule, RNG), saved and
  restored bit-exactly, and every reader's entry point (``read_state``, ``load_checkpoint``).
* ``optim_state``: the optimizer's state by parameter name in the Hugging Face layout, so a
  checkpoint resumes on either backend at any parallel layout.
* ``sharded``: megatron's sharded format (``trainer.checkpoint_format=sharded``), a file per
  model-parallel part, consolidated into ``trainer.pt``'s state for any other reader.

The format on disk is documented in docs/trainers.md.
"""
