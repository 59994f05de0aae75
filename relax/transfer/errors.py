"""Errors of the transfer layer. Each names the topic, writer, field or object at fault."""


class TransferError(RuntimeError):
    """Base class: something about the queue or weight store cannot proceed."""


class SchemaError(TransferError, ValueError):
    """A sample contradicts its topic's schema (field, dtype or shape). Raised before any write."""


class WriterConflict(TransferError):
    """Another live process already holds this writer id (one writer per log)."""


class StoreError(TransferError):
    """The root cannot be read or written, or an object in it is missing or corrupt."""


class QueueTimeout(TransferError, TimeoutError):
    """A wait (for data, capacity or a weight version) ran out of time."""
