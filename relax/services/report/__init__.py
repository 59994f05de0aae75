"""What a user sees of a run: per-role metrics logs (``metrics``) and PNG curves (``curves``)."""
