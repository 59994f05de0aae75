"""The HTTP fronts of a run: the elastic rollout REST API (``elastic``), the server that runs it
beside the rollout loop in the rollout's own process (``server``), and the session gateway that
external agents talk to (``gateway``)."""
