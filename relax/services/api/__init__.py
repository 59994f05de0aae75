"""The elastic rollout REST API: the scale operations and their FastAPI app (``elastic``), and the
server that runs it beside the rollout loop in the rollout's own process (``server``)."""
