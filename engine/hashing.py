"""Chained block hashes, shared by the engine's prefix cache and the router's
prefix index: ``h_i = H(h_{i-1}, tokens_i, salt)``.

Only full blocks are hashed. The salt isolates tenants (two different salts
never produce the same chain) and can carry anything else that must not be
shared, e.g. a model identity.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

BlockHash = int
"""64-bit block hash (fits a protobuf fixed64)."""

_ROOT = b"kvrelay-block-v1"
_BASE = hashlib.blake2b(digest_size=8, person=b"kvrelay-blk")
"""The initial state every block hash starts from (copied, never updated)."""


def hash_block(parent: BlockHash | None, tokens: Sequence[int], salt: str = "") -> BlockHash:
    """Hash of one full block, chained to its parent's hash.

    Args:
        parent: hash of the previous block, ``None`` for the first block.
        tokens: the block's token ids (exactly ``block_size`` of them).
        salt: isolation domain (tenant); part of every block's hash.
    """
    h = hashlib.blake2b(digest_size=8, person=b"kvrelay-blk")
    h.update(_ROOT if parent is None else parent.to_bytes(8, "little"))
    salt_bytes = salt.encode()
    h.update(len(salt_bytes).to_bytes(4, "little"))
    h.update(salt_bytes)
    h.update(array("q", tokens).tobytes())
    return int.from_bytes(h.digest(), "little")


def hash_blocks(tokens: Sequence[int], block_size: int, salt: str = "",
                parent: BlockHash | None = None, start_block: int = 0) -> list[BlockHash]:
    """Hashes of every full block of ``tokens`` from block ``start_block`` on
    (each equal to ``hash_block`` of that block and its parent).

    ``parent`` must be the hash of block ``start_block - 1`` when
    ``start_block > 0`` (so callers extend a chain without rehashing it).
    The token array is packed once and each block hashed in one call.
    """
    n_full = len(tokens) // block_size
    if n_full <= start_block:
        return []
    salt_bytes = salt.encode()
    salt_part = len(salt_bytes).to_bytes(4, "little") + salt_bytes
    width = block_size * 8
    data = memoryview(array("q", tokens[start_block * block_size:n_full * block_size]).tobytes())
    prev = _ROOT if parent is None else parent.to_bytes(8, "little")
    base, join, from_bytes = _BASE.copy, b"".join, int.from_bytes  # copying a keyed state beats building one
    out: list[BlockHash] = []
    for off in range(0, len(data), width):
        h = base()
        h.update(join((prev, salt_part, data[off:off + width])))
        prev = h.digest()
        out.append(from_bytes(prev, "little"))
    return out
