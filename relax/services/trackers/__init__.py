"""Experiment trackers (MLflow, W&B) fed from a run's metrics logs and lineage records (docs/tracking.md)."""
