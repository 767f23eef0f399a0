"""Transfer failures as data: which request, which blocks, why."""

from __future__ import annotations


class KVTransferError(Exception):
    """A KV transfer failed; the caller decides to retry, recompute or fail."""

    def __init__(self, request_id: str, reason: str, blocks: list[int] | None = None) -> None:
        super().__init__(f"KV transfer {request_id}: {reason}")
        self.request_id = request_id
        self.reason = reason
        self.blocks = blocks or []


class HandshakeRefused(KVTransferError):
    """The receiver refused the connection (version, layout, credentials, unknown transfer)."""


class TransferTimeout(KVTransferError):
    """The transfer did not complete before its deadline (or lease)."""
