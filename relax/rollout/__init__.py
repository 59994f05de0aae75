"""Rollout: prompts -> engines -> rewards -> TransferQueue rows.

* :mod:`relax.rollout.prompts`: the resumable prompt order and prompt encoding.
* :mod:`relax.rollout.engine_pool`: the engine-pool protocol and the in-process native engines.
* :mod:`relax.rollout.remote_engines`: engines behind URLs, routed least-loaded, with weight loading;
  :mod:`relax.rollout.engine_supervisor` replaces the owned ones that die.
* :mod:`relax.rollout.episodes`: one sample's episode, single-turn or multi-turn with an env.
* :mod:`relax.rollout.rewards`: reward dispatch (verifiers or a dotted-path function), errors recorded.
* :mod:`relax.rollout.judge`: rewards from a judge model behind an OpenAI-compatible URL.
* :mod:`relax.rollout.evaluation`: greedy held-out accuracy per task, modality and kind.

See docs/runtime.md.
"""
