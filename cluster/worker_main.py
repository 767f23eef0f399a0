"""Entry point of a worker process (``python -m prefill_worker`` /
``python -m decode_worker``): parse arguments and the config once, build
the engine, serve gRPC, register with the router, heartbeat."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
from pathlib import Path

import grpc

from cluster.config import load_config
from cluster.lifetime import die_with_parent
from cluster.worker_runtime import (GRPC_OPTIONS, WorkerIdentity, build_engine, kv_events, local_address_towards,
                                    register_and_heartbeat, serve_until_signal)
from engine.async_engine import AsyncEngine
from kvrelay.v1 import worker_pb2 as wpb
from kvrelay.v1 import worker_pb2_grpc as wgrpc


def parse_args(role: str, argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=f"{role}_worker")
    p.add_argument("--config", help="cluster config YAML (default: the embedded default)")
    p.add_argument("--model-path", required=True, help="checkpoint folder")
    p.add_argument("--router", required=True, help="router address host:port")
    p.add_argument("--site", required=True)
    p.add_argument("--index", type=int, default=0)
    p.add_argument("--host", help="address to bind and advertise (default: the config's workers.host)")
    p.add_argument("--log-level", default="INFO")
    return p.parse_args(argv)


def read_secret(cfg_path: str | None) -> bytes:
    """The KV deployment secret: the config's secret_file, else the launcher's
    per-run secret in $KVRELAY_KV_SECRET."""
    if cfg_path:
        return Path(cfg_path).read_bytes().strip()
    secret = os.environ.get("KVRELAY_KV_SECRET", "")
    if not secret:
        logging.getLogger(__name__).warning("no KV secret configured: KV connections are not authenticated")
    return secret.encode()


async def run(role: str, args: argparse.Namespace) -> None:
    from decode_worker.server import DecodeService
    from kvtransfer.local import shm_path_for
    from kvtransfer.select import choose_transport, make_receiver, make_sender
    from kvtransfer.tcp import TcpConfig
    from prefill_worker.server import PrefillService

    cfg = load_config(args.config)
    transport = choose_transport(cfg.kv.transport)
    tcp_cfg = TcpConfig(secret=read_secret(cfg.kv.secret_file), streams=cfg.kv.streams,
                        socket_buffer_bytes=cfg.kv.socket_buffer_bytes, encrypt=cfg.kv.encrypt,
                        stall_timeout_s=cfg.kv.transfer_timeout_s, corrupt_first=cfg.kv.corrupt_first_transfers)
    role_enum = wpb.ROLE_PREFILL if role == "prefill" else wpb.ROLE_DECODE
    ident = WorkerIdentity(f"{args.site}/{role}/{args.index}", role_enum, args.site)
    shm = shm_path_for(ident.worker_id, os.getpid()) if transport == "local" and role == "prefill" else None
    site = {s.name: s for s in cfg.sites}.get(args.site)
    if site is None:
        raise SystemExit(f"--site {args.site!r} is not a site of the config ({', '.join(s.name for s in cfg.sites)})")
    engine = build_engine(cfg, args.model_path, shm, getattr(site, role).device)
    aengine = AsyncEngine(engine)
    await aengine.start()
    server = grpc.aio.server(options=GRPC_OPTIONS)
    host = args.host or cfg.workers.host
    if host == "auto":
        host = local_address_towards(args.router)
    port = server.add_insecure_port(f"{host}:0")
    kv_endpoint = ""
    if role == "decode":
        receiver = make_receiver(transport, engine.cache, host, tcp_cfg)
        kv_endpoint = receiver.endpoint
        service = DecodeService(aengine, ident, receiver, cfg.router.kv_lease_s)
        wgrpc.add_DecodeWorkerServicer_to_server(service, server)
    else:
        service = PrefillService(aengine, ident, make_sender(transport, engine.cache, tcp_cfg),
                                 cfg.kv.transfer_timeout_s)
        wgrpc.add_PrefillWorkerServicer_to_server(service, server)
    await server.start()
    info = wpb.WorkerInfo(worker_id=ident.worker_id, role=role_enum, site=args.site, address=f"{host}:{port}",
                          kv_endpoint=kv_endpoint, transport=transport, model=engine.model_config.name,
                          layout_hash=engine.layout.compat_hash(), block_size=engine.layout.block_size,
                          num_blocks=engine.pool.num_blocks, num_layers=engine.layout.num_layers,
                          kv_block_bytes=2 * engine.layout.num_layers * engine.layout.block_bytes,
                          device=str(engine.cache.kv.device))
    logging.getLogger(__name__).info("%s serving on %s (kv %s)", ident.worker_id, info.address, kv_endpoint or "-")
    stop = asyncio.Event()
    hb = asyncio.create_task(register_and_heartbeat(args.router, info, service.load, stop,
                                                    lambda snapshot: kv_events(aengine, snapshot)))
    try:
        await serve_until_signal(server, aengine, stop, [hb])
    finally:
        engine.cache.unlink()


def main(role: str, argv: list[str] | None = None) -> int:
    die_with_parent()
    args = parse_args(role, argv)
    from kvtransfer.select import host_has_rdma

    if not host_has_rdma():  # UCX's InfiniBand module crashes processes at exit without devices
        os.environ.setdefault("UCX_MODULES", "^ib")
    logging.basicConfig(level=args.log_level, format=f"%(asctime)s {role}[{args.site}/{args.index}] %(levelname)s "
                        "%(name)s: %(message)s", stream=sys.stderr)
    asyncio.run(run(role, args))
    return 0
