"""TransferQueue, WeightStore and lineage records on any fsspec object store (docs/transfer.md)."""
