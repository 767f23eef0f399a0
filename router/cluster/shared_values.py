"""Every value a router reads from the routers' shared store (etcd), checked as strictly as a
gRPC input before it is applied (router/cluster/membership.py): a router's announcement
names a configured router at its configured site; a worker's record passes Register's checks
(a known site, a valid role, a worker id spelling that site and role: the certificate identity
the router then pins its channel to, so the site and role placement reads are the
certificate's, never only etcd's word); a drain names a worker id; a pool's size names a
configured pool and a count in range. A value that fails is not applied (:class:`BadValue`
naming the key and why): the membership skips it with an audit record and watches on.

etcd admits only the routers to write these keys (launch/etcd_auth.py); the checks hold even
against a router's certificate in the wrong hands, or a store restored from elsewhere."""

from __future__ import annotations

import re
from dataclasses import dataclass

from google.protobuf.message import DecodeError

from kvrelay.router.cluster.registry import worker_problem
from kvrelay.runtime.config import ClusterConfig
from kvrelay.runtime.roles import Role
from kvrelay.v1 import inference_pb2 as ipb
from kvrelay.v1 import worker_pb2 as wpb

MAX_VALUE_BYTES = 64 * 1024
"""The largest value any of these keys holds (a worker's record is a few hundred bytes)."""
MAX_REPLICAS = 1_000_000
_ADDRESS = re.compile(r"[A-Za-z0-9.\-\[\]:]{1,255}:\d{1,5}")
_JURISDICTION = re.compile(r"[A-Z]{2}(-[A-Z0-9]{1,8})?")


class BadValue(ValueError):
    """A value in the shared store that is not applied: the message says why."""


@dataclass(slots=True, frozen=True)
class SharedNames:
    """What the values may name: the configured routers (name -> site) and sites."""

    routers: dict[str, str]
    sites: frozenset[str]

    @classmethod
    def of(cls, cfg: ClusterConfig) -> SharedNames:
        return cls({r.name: r.site for r in cfg.routers}, frozenset(s.name for s in cfg.sites))


def _parse(kind, value: bytes):
    if len(value) > MAX_VALUE_BYTES:
        raise BadValue(f"{len(value)} bytes, over the {MAX_VALUE_BYTES} any such value holds")
    try:
        return kind.FromString(value)
    except DecodeError:
        raise BadValue(f"not a {kind.DESCRIPTOR.name} (it does not parse)") from None


def _address(what: str, address: str, optional: bool = False) -> None:
    if (address or not optional) and not _ADDRESS.fullmatch(address):
        raise BadValue(f"{what} {address[:80]!r} is not host:port")


def router_peer(names: SharedNames, name: str, value: bytes) -> ipb.RouterPeer:
    """``routers/<name>``: a configured router's announcement, at its configured site."""
    if name not in names.routers:
        raise BadValue(f"router {name[:80]!r} is not one of the config's routers ({', '.join(sorted(names.routers))})")
    peer: ipb.RouterPeer = _parse(ipb.RouterPeer, value)
    if peer.name != name:
        raise BadValue(f"it names router {peer.name[:80]!r}, not {name!r}")
    if peer.site != names.routers[name]:
        raise BadValue(f"it puts router {name} at {peer.site[:80]!r}; the config puts it at {names.routers[name]}")
    _address("address", peer.address)
    _address("internal_address", peer.internal_address)
    _address("http_address", peer.http_address, optional=True)
    if peer.jurisdiction and not _JURISDICTION.fullmatch(peer.jurisdiction):
        raise BadValue(f"jurisdiction {peer.jurisdiction[:40]!r} is not a jurisdiction code")
    return peer


def worker_info(names: SharedNames, name: str, value: bytes) -> wpb.WorkerInfo:
    """``workers/<id>``: a worker's record, as Register would accept it."""
    info: wpb.WorkerInfo = _parse(wpb.WorkerInfo, value)
    if info.worker_id != name:
        raise BadValue(f"it holds worker {info.worker_id[:80]!r}, not {name[:80]!r}")
    problem = worker_problem(info, names.sites)
    if problem is not None:
        raise BadValue(problem)
    _address("address", info.address)
    _address("kv_endpoint", info.kv_endpoint, optional=True)
    _address("metrics_address", info.metrics_address, optional=True)
    if min(info.block_size, info.num_blocks, info.num_layers) < 0:
        raise BadValue("block_size, num_blocks and num_layers must not be negative")
    return info


def drain(name: str, value: bytes) -> str:
    """``drains/<id>``: a worker to drain (the value is empty)."""
    site, _, rest = name.partition("/")
    role, _, worker = rest.partition("/")
    if not (site and worker and role in tuple(Role)) or value:
        raise BadValue("a drain is an empty value under a worker id (<site>/<role>/<name>)")
    return name


def pool_size(names: SharedNames, name: str, value: bytes) -> tuple[tuple[str, Role], int]:
    """``pools/<site>/<role>``: a pool's desired size."""
    site, _, role = name.partition("/")
    if site not in names.sites or role not in tuple(Role):
        raise BadValue(f"{name[:80]!r} is not a pool (<site>/<role> of a configured site)")
    text = value.decode("ascii", "replace")
    if not text.isdigit() or int(text) > MAX_REPLICAS:
        raise BadValue(f"a pool's size is a count of replicas 0..{MAX_REPLICAS}, got {text[:40]!r}")
    return (site, Role(role)), int(text)
