"""Errors the engine raises. Each names the problem in its message."""


class EngineError(Exception):
    """Root of the engine's errors."""


class CheckpointError(EngineError):
    """A checkpoint folder is missing, truncated, inconsistent or unsupported."""


class InvalidRequestError(EngineError, ValueError):
    """A request cannot be served as given (too long, bad parameters)."""


class OutOfBlocksError(EngineError):
    """The block pool cannot satisfy an allocation."""
