"""Where the engine servers a rollout owns run: local child processes (``process``) or Ray actors
(``ray_actors``). Both refuse a launch they cannot satisfy as a whole (``CapacityError``)."""
