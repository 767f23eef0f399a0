"""Same workload as the replay (40 requests, 128 random prompt tokens, 16 forced
output tokens, one every 2 s), sent through the HTTP API with the official
openai client (async, streaming), timing TTFT and inter-token gaps at the client.

Against `kvrelay serve` with the local default: https, verified by the per-user
CA, with the per-user tenant token (both under the cache folder)."""
import asyncio
import os
import random
import ssl
import statistics
import time
from pathlib import Path

import openai

CACHE = Path(os.environ.get("KVRELAY_CACHE_DIR") or Path.home() / ".cache" / "kvrelay")
HTTP_CLIENT = getattr(openai, "DefaultAsyncHttpx2Client", None) or openai.DefaultAsyncHttpxClient


async def one(client, i, t0, out):
    await asyncio.sleep(max(0.0, t0 + 2.0 * i - time.perf_counter()))
    rng = random.Random(i)
    prompt = [rng.randrange(100, 10000) for _ in range(128)]
    sent = time.perf_counter()
    times = []
    stream = await client.completions.create(model="SmolLM2-135M-Instruct", prompt=prompt, max_tokens=16,
                                             temperature=0, stream=True, extra_body={"ignore_eos": True})
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].text:
            times.append(time.perf_counter())
    out.append((times[0] - sent, [b - a for a, b in zip(times, times[1:])], len(times)))

async def main():
    tls = ssl.create_default_context(cafile=str(CACHE / "pki" / "ca.pem"))
    client = openai.AsyncOpenAI(base_url="https://127.0.0.1:8000/v1",
                                api_key=(CACHE / "client-token").read_text().strip(),
                                max_retries=0, http_client=HTTP_CLIENT(verify=tls))
    out = []
    t0 = time.perf_counter()
    await asyncio.gather(*(one(client, i, t0, out) for i in range(40)))
    ttft = [o[0] * 1e3 for o in out]
    itl = [g * 1e3 for o in out for g in o[1]]
    print(f"requests {len(out)}; text chunks per request {statistics.mean(o[2] for o in out):.1f}")
    print(f"TTFT ms mean {statistics.mean(ttft):.1f} median {statistics.median(ttft):.1f}")
    print(f"ITL ms mean {statistics.mean(itl):.1f} median {statistics.median(itl):.1f}")


if __name__ == "__main__":
    asyncio.run(main())
