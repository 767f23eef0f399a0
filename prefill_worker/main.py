"""The prefill worker process (``python -m kvrelay.prefill_worker``): the shared
worker start (runtime/worker.py) plus this worker's own side, a KV sender
and the PrefillWorker gRPC service."""

from __future__ import annotations

import os

from kvrelay.kvtransfer.base import Transport
from kvrelay.kvtransfer.local import shm_path_for
from kvrelay.kvtransfer.select import make_sender
from kvrelay.prefill_worker.server import PrefillService
from kvrelay.runtime.roles import Role
from kvrelay.runtime.worker import (
    WorkerSetup,
    listening_server,
    serve_worker,
    start_engine,
    worker_info,
    worker_main,
)
from kvrelay.runtime.worker_telemetry import WorkerTelemetry
from kvrelay.v1 import worker_pb2_grpc as wgrpc


async def run(setup: WorkerSetup) -> None:
    # the local transport shares this worker's KV memory with decode workers on the same host
    shm = shm_path_for(setup.ident.worker_id, os.getpid()) if setup.transport is Transport.LOCAL else None
    aengine = await start_engine(setup, shm)
    server, port = listening_server(setup)
    sender = make_sender(setup.transport, aengine.engine.cache, setup.transfer)
    tel = WorkerTelemetry(setup.cfg.telemetry, Role.PREFILL, setup.ident.worker_id, setup.ident.site)
    service = PrefillService(aengine, setup.ident, sender, setup.cfg.kv.transfer_timeout_s, tel)
    wgrpc.add_PrefillWorkerServicer_to_server(service, server)
    info = worker_info(setup, aengine.engine, port, "")
    info.metrics_address = tel.serve(aengine.engine, setup.host, setup.tls)
    try:
        await serve_worker(setup, aengine, server, info, service.load)
    finally:
        tel.close()


def main(argv: list[str] | None = None) -> int:
    return worker_main(Role.PREFILL, argv, run)
