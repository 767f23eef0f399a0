"""What a worker does: a closed set, below the config (which names a site's pool per role)."""

from __future__ import annotations

from enum import StrEnum

from kvrelay.v1 import worker_pb2 as wpb


class Role(StrEnum):
    """What a worker does; its value is the config's and the CLI's word for it."""

    PREFILL = "prefill"
    DECODE = "decode"

    @property
    def proto(self) -> wpb.Role:
        """The role as ``worker.proto`` spells it."""
        return wpb.ROLE_PREFILL if self is Role.PREFILL else wpb.ROLE_DECODE

    @classmethod
    def of(cls, proto_role: int) -> Role:
        """The role of a ``WorkerInfo.role``; ValueError for an unknown one."""
        if proto_role == wpb.ROLE_PREFILL:
            return cls.PREFILL
        if proto_role == wpb.ROLE_DECODE:
            return cls.DECODE
        raise ValueError(f"role must be prefill or decode, got {proto_role}")
