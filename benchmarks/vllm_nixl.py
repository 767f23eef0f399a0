"""vLLM's own disaggregation for ``kvrelay bench vllm-pd`` (system
``vllm_nixl_pd``): two ``vllm serve`` processes, a prefill and a decode
instance, each with vLLM's NixlConnector (``kv_buffer_device: cpu``, KV
pulled by the decode instance over NIXL/UCX), and the proxy vLLM's examples
put in front of them, written here from vLLM's documented protocol (vLLM's
wheel ships no proxy):

1. the request goes to the prefill instance with ``max_tokens`` 1, not
   streamed, and ``kv_transfer_params`` asking for a remote decode;
2. the prefill's answer carries ``kv_transfer_params`` (its engine, blocks,
   host and port); the original request goes to the decode instance with
   them, and its stream is the client's.

Run as ``python -m kvrelay.benchmarks.vllm_nixl --port P --prefill URL
--decode URL`` (the benchmark starts it)."""

from __future__ import annotations

import argparse
import json

import aiohttp
from aiohttp import web

REMOTE_DECODE = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                 "remote_block_ids": None, "remote_host": None, "remote_port": None}
"""What a request to the prefill instance carries: compute the prompt, keep its blocks for a decode instance."""
TIMEOUT = aiohttp.ClientTimeout(total=600)


def kv_transfer_config() -> str:
    """``--kv-transfer-config`` of both instances: NixlConnector on host memory."""
    return json.dumps({"kv_connector": "NixlConnector", "kv_role": "kv_both", "kv_buffer_device": "cpu"})


def prefill_body(body: dict) -> dict:
    """The client's request as the prefill instance gets it."""
    out = {k: v for k, v in body.items() if k not in ("stream", "stream_options")}
    return out | {"max_tokens": 1, "stream": False, "kv_transfer_params": REMOTE_DECODE}


async def _forward(request: web.Request) -> web.StreamResponse:
    body = await request.json()
    app = request.app
    session: aiohttp.ClientSession = app["session"]
    headers = {"X-Request-Id": request.headers.get("X-Request-Id", "")} if "X-Request-Id" in request.headers else {}
    async with session.post(app["prefill"] + request.path, json=prefill_body(body), headers=headers) as resp:
        if resp.status != 200:
            return web.Response(status=resp.status, body=await resp.read(), content_type="application/json")
        params = (await resp.json()).get("kv_transfer_params")
    async with session.post(app["decode"] + request.path, json=body | {"kv_transfer_params": params},
                            headers=headers) as resp:
        out = web.StreamResponse(status=resp.status, headers={"Content-Type": resp.content_type})
        await out.prepare(request)
        async for chunk in resp.content.iter_any():
            await out.write(chunk)
        await out.write_eof()
        return out


async def _health(_request: web.Request) -> web.Response:
    return web.Response(text="ok")


async def _session(app: web.Application):
    app["session"] = aiohttp.ClientSession(timeout=TIMEOUT)
    yield
    await app["session"].close()


def proxy_app(prefill: str, decode: str) -> web.Application:
    """The proxy: /v1/completions and /v1/chat/completions through prefill, then decode."""
    app = web.Application()
    app["prefill"], app["decode"] = prefill.rstrip("/"), decode.rstrip("/")
    app.cleanup_ctx.append(_session)
    app.router.add_post("/v1/completions", _forward)
    app.router.add_post("/v1/chat/completions", _forward)
    app.router.add_get("/health", _health)
    return app


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="vllm_nixl", description="vLLM P/D proxy (prefill, then decode)")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--prefill", required=True, help="the prefill instance's base URL")
    p.add_argument("--decode", required=True, help="the decode instance's base URL")
    args = p.parse_args(argv)
    web.run_app(proxy_app(args.prefill, args.decode), host="127.0.0.1", port=args.port, print=None)


if __name__ == "__main__":
    main()
