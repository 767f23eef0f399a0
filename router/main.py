"""Entry point of the router process (``python -m router``). Prints
``READY host:port [http=host:port]`` on stdout once serving (gRPC, then the
OpenAI-compatible HTTP API when enabled), for the launcher."""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys

from kvrelay.v1 import jobs_pb2_grpc as jgrpc

from engine.config import ModelConfig, effective_max_model_len
from engine.tokenizer import Tokenizer
from router.core import RouterCore
from router.grpc_api import add_router_to_server
from router.jobs import JobService
from router.openai_http import OpenAIServer, serve_http
from router.requests import ModelLimits
from runtime.config import load_config
from runtime.lifetime import die_with_parent
from runtime.rpc import bind, create_server


async def run(args: argparse.Namespace) -> None:
    cfg = load_config(args.config)
    model_cfg = ModelConfig.from_file(f"{args.model_path}/config.json")
    max_len = effective_max_model_len(model_cfg, cfg.scheduler)
    tok = Tokenizer(args.model_path)
    limits = ModelLimits(name=args.model_name or model_cfg.name, max_model_len=max_len,
                         vocab_size=model_cfg.vocab_size, chat=tok.has_chat_template)
    core = RouterCore(cfg, tok, limits)
    server = create_server()
    add_router_to_server(core, server)
    jobs = JobService(core, args.jobs_db or cfg.router.jobs_db or ":memory:", cfg.router.job_concurrency)
    if not (args.jobs_db or cfg.router.jobs_db):
        logging.getLogger(__name__).warning("router.jobs_db is not set: batch jobs live in memory only")
    await jobs.start()
    jgrpc.add_JobsServicer_to_server(jobs, server)
    host = cfg.router.host
    try:
        port = bind(server, host, cfg.router.port)
    except OSError as exc:
        raise SystemExit(f"router: {exc}") from None
    await server.start()
    ready = f"READY {host}:{port}"
    http = None
    if cfg.router.http_port is not None:

        http, http_task, http_port = await serve_http(OpenAIServer(core).app, host, cfg.router.http_port)
        ready += f" http={host}:{http_port}"
    print(ready, flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    if http is not None:
        http.should_exit = True
        await asyncio.wait_for(http_task, 5.0)
    await server.stop(grace=2.0)
    await jobs.stop()
    await core.registry.close()


def main(argv: list[str] | None = None) -> int:
    die_with_parent()
    p = argparse.ArgumentParser(prog="router")
    p.add_argument("--config")
    p.add_argument("--model-path", required=True)
    p.add_argument("--model-name", help="name clients use (default: the checkpoint folder's name)")
    p.add_argument("--jobs-db", help="SQLite file for batch jobs (overrides router.jobs_db)")
    p.add_argument("--log-level", default="INFO")
    args = p.parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s router %(levelname)s %(name)s: %(message)s",
                        stream=sys.stderr)
    asyncio.run(run(args))
    return 0
