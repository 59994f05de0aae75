"""Rollout: prompts -> engine -> rewards -> TransferQueue rows.

* :mod:`relax.rollout.prompts` — the resumable prompt order and prompt encoding.
* :mod:`relax.rollout.engines` — the engines a rollout drives: in-process native engines or
  any SGLang-compatible URL behind the router.
* :mod:`relax.rollout.rewards` — reward dispatch (task verifiers or a dotted-path function)
  that turns a raising reward function into a recorded error, never a crash.
* :mod:`relax.rollout.agent` — the multi-turn agent loop for tasks with an ``Env``.
* :mod:`relax.rollout.samples` — completions -> queue rows (tokens, loss mask, logprobs).

See docs/runtime.md.
"""
