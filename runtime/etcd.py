"""An asyncio client of etcd's v3 gRPC API (the subset in proto/kvrelay/v1/etcd.proto):
keys, leases, watches and status, over the cluster's TLS (each member's certificate
from the cluster CA, and ours presented to it). One channel per endpoint; a call that
finds its member gone moves to the next endpoint, so a cluster that lost a minority
of its members serves on. Every call has a deadline; failures are :class:`EtcdError`,
naming the endpoints tried and why."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

import grpc

from kvrelay.runtime.pki import CertRole, role_dns
from kvrelay.runtime.rpc import Dialer
from kvrelay.v1 import etcd_pb2 as epb
from kvrelay.v1 import etcd_pb2_grpc as egrpc

log = logging.getLogger(__name__)

T = TypeVar("T")

_MOVE_ON = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
WATCH_QUIET_S = 10.0
"""A watch silent this long asks its member for progress (an answer proves the stream alive)."""
"""Codes after which the next endpoint is tried (the member is gone or cut off)."""


class EtcdError(RuntimeError):
    """etcd could not be reached or refused a call; the message names the endpoints and why."""


@dataclass(frozen=True, slots=True)
class Entry:
    """One key of etcd and its value."""

    key: str
    value: bytes
    mod_revision: int
    lease: int


@dataclass(frozen=True, slots=True)
class Change:
    """One watched change: ``value`` None when the key was deleted (or its lease expired)."""

    key: str
    value: bytes | None
    revision: int


def prefix_end(prefix: str) -> bytes:
    """The end of the key range holding every key that starts with ``prefix``."""
    raw = bytearray(prefix.encode())
    while raw and raw[-1] == 0xFF:
        raw.pop()
    if not raw:
        return b"\0"
    raw[-1] += 1
    return bytes(raw)


def _why(exc: grpc.aio.AioRpcError) -> str:
    details = exc.details() or ""
    if "CERTIFICATE_VERIFY_FAILED" in details or "certificate" in details.lower() or "handshake" in details.lower():
        return f"TLS refused ({details.strip()[:160]}): is its certificate from this cluster's CA, and ours?"
    return f"{exc.code().name}: {details.strip()[:160]}"


class _Endpoint:
    """One member's channel and stubs."""

    def __init__(self, address: str, dialer: Dialer, server_name: str) -> None:
        self.address = address
        self.channel = dialer.aio(address, server_name=server_name,
                                  options=(("grpc.initial_reconnect_backoff_ms", 200),
                                           ("grpc.max_reconnect_backoff_ms", 1000)))
        self.kv = egrpc.KVStub(self.channel)
        self.lease = egrpc.LeaseStub(self.channel)
        self.watch = egrpc.WatchStub(self.channel)
        self.maintenance = egrpc.MaintenanceStub(self.channel)
        self.auth = egrpc.AuthStub(self.channel)


async def _read_into(call, answers: asyncio.Queue) -> None:
    """Every answer of a watch stream into ``answers``, then its end (EOF, or the error that ended it)."""
    try:
        while True:
            resp = await call.read()
            answers.put_nowait(resp)
            if resp is grpc.aio.EOF:
                return
    except grpc.aio.AioRpcError as exc:
        answers.put_nowait(exc)


class EtcdClient:
    """A client of one etcd cluster (``endpoints``: its members' client addresses)."""

    def __init__(self, endpoints: list[str], dialer: Dialer, timeout_s: float,
                 server_name: str = role_dns(CertRole.ETCD), quiet_s: float = WATCH_QUIET_S) -> None:
        """``dialer``: our certificate and the CA the members' certificates must come from;
        ``server_name``: the name the members' certificates carry (every etcd member's);
        ``quiet_s``: a watch silent this long asks its member for progress (see :meth:`watch`)."""
        if not endpoints:
            raise EtcdError("no etcd endpoints (etcd.endpoints)")
        self.timeout_s, self.quiet_s = timeout_s, quiet_s
        self._dialer, self._server_name = dialer, server_name
        self._endpoints = [_Endpoint(a, dialer, server_name) for a in endpoints]
        self._current = 0
        self._retired: set[asyncio.Task] = set()

    def redial(self, grace_s: float) -> None:
        """New channels to every member (after this process's certificate was renewed); calls in
        flight on the old ones get ``grace_s`` to end (a watch is then ended, and made again)."""
        old, self._endpoints = self._endpoints, [_Endpoint(e.address, self._dialer, self._server_name)
                                                 for e in self._endpoints]
        for ep in old:
            task = asyncio.get_running_loop().create_task(ep.channel.close(grace=grace_s))
            self._retired.add(task)
            task.add_done_callback(self._retired.discard)

    @property
    def endpoints(self) -> list[str]:
        return [e.address for e in self._endpoints]

    async def _call(self, fn: Callable[[_Endpoint], Awaitable[T]]) -> T:
        """``fn`` on the current member, then on each other one while members are gone."""
        errors = []
        for i in range(len(self._endpoints)):
            ep = self._endpoints[(self._current + i) % len(self._endpoints)]
            try:
                out = await fn(ep)
            except grpc.aio.AioRpcError as exc:
                errors.append(f"{ep.address}: {_why(exc)}")
                if exc.code() not in _MOVE_ON:
                    break
                continue
            self._current = self._endpoints.index(ep)
            return out
        raise EtcdError("etcd: " + "; ".join(errors))

    async def connect(self) -> epb.StatusResponse:
        """Reaches a member within ``timeout_s`` (retrying while none answers yet); its status.
        EtcdError naming every endpoint and why, when none answered."""
        loop = asyncio.get_running_loop()
        end = loop.time() + self.timeout_s
        while True:
            try:
                return await self.status()
            except EtcdError as exc:
                if loop.time() + 0.2 >= end or "TLS refused" in str(exc):
                    raise EtcdError(f"could not reach etcd within {self.timeout_s:g} s: {exc}") from None
            await asyncio.sleep(0.2)

    async def status(self) -> epb.StatusResponse:
        """The status of the member that answers (its leader, its errors)."""
        return await self._call(lambda ep: ep.maintenance.Status(epb.StatusRequest(), timeout=self.timeout_s))

    async def member_status(self) -> list[tuple[str, str]]:
        """Each endpoint and what it says now ("ok", or why not), asked in parallel."""
        async def one(ep: _Endpoint) -> tuple[str, str]:
            try:
                st = await ep.maintenance.Status(epb.StatusRequest(), timeout=min(self.timeout_s, 2.0))
            except grpc.aio.AioRpcError as exc:
                return ep.address, _why(exc)
            return ep.address, "ok" if st.leader else "no leader"
        return list(await asyncio.gather(*(one(ep) for ep in self._endpoints)))

    async def auth(self, method: str, request, token: str = ""):
        """One call of etcd's Auth service (``method``: ``RoleAdd``, ``UserAdd``, ``AuthEnable``, ...),
        as our certificate's user, or ``token``'s (from ``Authenticate``); its answer."""
        metadata = (("token", token),) if token else None
        return await self._call(lambda ep: getattr(ep.auth, method)(request, timeout=self.timeout_s,
                                                                   metadata=metadata))

    async def get_prefix(self, prefix: str) -> tuple[list[Entry], int]:
        """Every key under ``prefix`` (a quorum read) and the store's revision then."""
        req = epb.RangeRequest(key=prefix.encode(), range_end=prefix_end(prefix))
        resp = await self._call(lambda ep: ep.kv.Range(req, timeout=self.timeout_s))
        return [Entry(kv.key.decode(), kv.value, kv.mod_revision, kv.lease) for kv in resp.kvs], resp.header.revision

    async def get(self, key: str) -> Entry | None:
        resp = await self._call(lambda ep: ep.kv.Range(epb.RangeRequest(key=key.encode()), timeout=self.timeout_s))
        return next((Entry(kv.key.decode(), kv.value, kv.mod_revision, kv.lease) for kv in resp.kvs), None)

    async def put(self, key: str, value: bytes, lease: int = 0) -> int:
        """Writes ``key``; its revision."""
        req = epb.PutRequest(key=key.encode(), value=value, lease=lease)
        resp = await self._call(lambda ep: ep.kv.Put(req, timeout=self.timeout_s))
        return resp.header.revision

    async def delete(self, key: str) -> int:
        """Deletes ``key``; how many keys went (0 or 1)."""
        req = epb.DeleteRangeRequest(key=key.encode())
        return (await self._call(lambda ep: ep.kv.DeleteRange(req, timeout=self.timeout_s))).deleted

    async def create(self, key: str, value: bytes, lease: int = 0) -> bool:
        """Writes ``key`` only if it does not exist (one transaction); whether it was written."""
        req = epb.TxnRequest(
            compare=[epb.Compare(result=epb.Compare.EQUAL, target=epb.Compare.CREATE, key=key.encode(),
                                 create_revision=0)],
            success=[epb.RequestOp(request_put=epb.PutRequest(key=key.encode(), value=value, lease=lease))])
        return (await self._call(lambda ep: ep.kv.Txn(req, timeout=self.timeout_s))).succeeded

    async def grant(self, ttl_s: int) -> int:
        """A new lease of ``ttl_s`` seconds; its id."""
        resp = await self._call(lambda ep: ep.lease.LeaseGrant(epb.LeaseGrantRequest(TTL=ttl_s),
                                                               timeout=self.timeout_s))
        if resp.error:
            raise EtcdError(f"etcd refused a lease: {resp.error}")
        return resp.ID

    async def keepalive(self, lease: int) -> int:
        """Renews ``lease``; the seconds it has left (0 or less: it expired, its keys are gone)."""
        async def once(ep: _Endpoint) -> int:
            call = ep.lease.LeaseKeepAlive(timeout=self.timeout_s)
            try:
                await call.write(epb.LeaseKeepAliveRequest(ID=lease))
                resp = await call.read()
                await call.done_writing()
            finally:
                call.cancel()
            if resp is grpc.aio.EOF:
                raise EtcdError(f"{ep.address} closed the lease stream")
            return resp.TTL
        return await self._call(once)

    async def revoke(self, lease: int) -> None:
        """Ends ``lease`` now (its keys are deleted)."""
        await self._call(lambda ep: ep.lease.LeaseRevoke(epb.LeaseRevokeRequest(ID=lease), timeout=self.timeout_s))

    async def watch(self, prefix: str, start_revision: int) -> AsyncIterator[list[Change]]:
        """The changes under ``prefix`` from ``start_revision`` on, a batch at a time (an empty
        batch first, once the member accepted the watch), until the stream breaks (EtcdError; the
        caller watches again from its last revision + 1, on the next member). EtcdError too when
        that revision was compacted away (read again), and when the member stops answering: a
        watch silent for ``quiet_s`` asks for progress, and one that gets no answer within
        ``timeout_s`` is given up (a member that hangs with its connection open, or one cut off
        from the others, would otherwise keep this router deaf to every change)."""
        ep = self._endpoints[self._current]
        call = ep.watch.Watch()
        answers: asyncio.Queue = asyncio.Queue()
        reader: asyncio.Task | None = None
        try:
            try:
                await call.write(epb.WatchRequest(create_request=epb.WatchCreateRequest(
                    key=prefix.encode(), range_end=prefix_end(prefix), start_revision=start_revision)))
            except grpc.aio.AioRpcError as exc:  # a member that is gone fails the request as it fails a read
                self._current = (self._current + 1) % len(self._endpoints)
                raise EtcdError(f"etcd watch on {ep.address} ended: {_why(exc)}") from None
            reader = asyncio.create_task(_read_into(call, answers))
            while True:
                resp = await self._next_answer(call, answers, ep)
                if resp.compact_revision or resp.canceled:
                    raise EtcdError(f"etcd watch on {ep.address} refused: "
                                    f"{resp.cancel_reason or f'compacted to {resp.compact_revision}'}")
                if resp.events or resp.created:
                    yield [Change(e.kv.key.decode(), e.kv.value if e.type == epb.Event.PUT else None,
                                  e.kv.mod_revision) for e in resp.events]
        finally:
            if reader is not None:
                reader.cancel()
            call.cancel()

    async def _next_answer(self, call, answers: asyncio.Queue, ep: _Endpoint) -> epb.WatchResponse:
        """The watch's next answer; after ``quiet_s`` of silence a progress request, and EtcdError (the
        next member is tried next) when that gets no answer within ``timeout_s``, or the stream ends."""
        asked = False
        while True:
            try:
                item = await asyncio.wait_for(answers.get(), self.timeout_s if asked else self.quiet_s)
            except TimeoutError:
                if asked:
                    self._current = (self._current + 1) % len(self._endpoints)
                    raise EtcdError(f"etcd watch on {ep.address}: no answer to a progress request within "
                                    f"{self.timeout_s:g} s") from None
                try:
                    await call.write(epb.WatchRequest(progress_request=epb.WatchProgressRequest()))
                except grpc.aio.AioRpcError:
                    pass  # the stream broke: its reader says how
                asked = True
                continue
            if isinstance(item, grpc.aio.AioRpcError) or item is grpc.aio.EOF:
                self._current = (self._current + 1) % len(self._endpoints)
                why = f": {_why(item)}" if isinstance(item, grpc.aio.AioRpcError) else ""
                raise EtcdError(f"etcd watch on {ep.address} ended{why}")
            return item

    async def close(self) -> None:
        for ep in self._endpoints:
            await ep.channel.close()
        for task in list(self._retired):
            task.cancel()
