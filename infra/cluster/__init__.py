"""A Flyte cluster, minus Kubernetes, for tests and dry runs (``python infra/cluster_run.py``)."""
