"""Where the engine servers a rollout owns run: local child processes (``process``, SGLang servers
``sglang_process``) or Ray actors (``ray_actors``), the one chosen by the config in ``factory``.
Every launcher refuses a launch it cannot satisfy as a whole (``CapacityError``)."""
