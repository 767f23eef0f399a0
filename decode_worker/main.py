"""The decode worker process (``python -m kvrelay.decode_worker``): the shared
worker start (runtime/worker.py) plus this worker's own side, a KV receiver
and the DecodeWorker gRPC service."""

from __future__ import annotations

from kvrelay.decode_worker.server import DecodeService
from kvrelay.kvtransfer.select import make_receiver
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
    aengine = await start_engine(setup)
    server, port = listening_server(setup)
    receiver = make_receiver(setup.transport, aengine.engine.cache, setup.host, setup.transfer)
    tel = WorkerTelemetry(setup.cfg.telemetry, Role.DECODE, setup.ident.worker_id, setup.ident.site)
    service = DecodeService(aengine, setup.ident, receiver, setup.cfg.router.liveness.kv_lease_s, tel)
    wgrpc.add_DecodeWorkerServicer_to_server(service, server)
    info = worker_info(setup, aengine.engine, port, receiver.endpoint)
    info.metrics_address = tel.serve(aengine.engine, setup.host, setup.tls)
    try:
        await serve_worker(setup, aengine, server, info, service.load)
    finally:
        tel.close()


def main(argv: list[str] | None = None) -> int:
    return worker_main(Role.DECODE, argv, run)
