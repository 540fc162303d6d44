"""CPU per request of the inference-server client: Miles' ServerClient against the httpx client it replaced.

A rollout worker keeps hundreds of generation requests in flight and plays episodes on the same CPU, so
what the HTTP client spends per request is taken from the worker. Both clients post the same vLLM-shaped
``/inference/v1/generate`` request (a 60-token prompt) to the same server, a separate process that answers
at once with a canned 24-token reply, so the figure is the client's own work (the server's CPU is not in
it). The "before" arm is ``httpx.AsyncClient`` exactly as the engines built it (512 connections, 64 kept
alive); the "after" arm is :class:`miles.engines.server_client.ServerClient`. Arms alternate, ``--repeats``
times each, at each concurrency; the table gives the median CPU ms per request and the ratio.

    python benchmarks/server_client.py --out benchmarks/results/server_client.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import httpx

from miles.engines.server_client import ServerClient

PATH = "/inference/v1/generate"
PAYLOAD = {
    "token_ids": list(range(1000, 1060)),
    "sampling_params": {"max_tokens": 24, "temperature": 1.0, "top_p": 1.0, "stop_token_ids": [2], "logprobs": 0},
}

SERVER = r"""
import asyncio, json, sys
BODY = json.dumps({"choices": [{"token_ids": list(range(24)), "finish_reason": "stop",
    "logprobs": {"content": [{"token_id": i, "logprob": -0.5} for i in range(24)]},
    "weight_versions": [{"version": "3", "start": 0, "end": 24}]}]}).encode()
HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n" % len(BODY)
async def handle(reader, writer):
    try:
        while True:
            head = await reader.readuntil(b"\r\n\r\n")
            length = 0
            for line in head.split(b"\r\n"):
                if line.lower().startswith(b"content-length:"):
                    length = int(line.split(b":")[1])
            if length:
                await reader.readexactly(length)
            writer.write(HEAD + BODY)
    except (asyncio.IncompleteReadError, ConnectionError):
        writer.close()
async def main():
    server = await asyncio.start_server(handle, "127.0.0.1", 0, backlog=1024)
    print(server.sockets[0].getsockname()[1], flush=True)
    async with server:
        await server.serve_forever()
asyncio.run(main())
"""


async def measure(one: Callable[[], Awaitable[None]], requests: int, in_flight: int) -> dict[str, float]:
    gate = asyncio.Semaphore(in_flight)

    async def limited() -> None:
        async with gate:
            await one()

    await asyncio.gather(*(limited() for _ in range(min(requests, 2 * in_flight))))  # warm the pool
    cpu, wall = time.process_time(), time.perf_counter()
    await asyncio.gather(*(limited() for _ in range(requests)))
    return {
        "cpu_ms_per_request": (time.process_time() - cpu) / requests * 1e3,
        "wall_ms_per_request": (time.perf_counter() - wall) / requests * 1e3,
    }


async def httpx_arm(url: str, requests: int, in_flight: int) -> dict[str, float]:
    async with httpx.AsyncClient(
        base_url=url,
        timeout=httpx.Timeout(60.0, pool=None),
        limits=httpx.Limits(max_connections=512, max_keepalive_connections=64),
    ) as client:

        async def one() -> None:
            response = await client.post(PATH, json=PAYLOAD)
            response.json()

        return await measure(one, requests, in_flight)


async def miles_arm(url: str, requests: int, in_flight: int) -> dict[str, float]:
    async with ServerClient(url, server="bench", timeout_s=60.0) as client:

        async def one() -> None:
            await client.call("POST", PATH, json_body=PAYLOAD)

        return await measure(one, requests, in_flight)


ARMS = {"httpx (before)": httpx_arm, "ServerClient (after)": miles_arm}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--in-flight", type=int, nargs="+", default=[1, 64, 256])
    parser.add_argument("--requests", type=int, default=3000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()

    server = subprocess.Popen([sys.executable, "-c", SERVER], stdout=subprocess.PIPE, text=True)
    try:
        assert server.stdout is not None
        url = f"http://127.0.0.1:{server.stdout.readline().strip()}"
        rows = []
        for in_flight in args.in_flight:
            samples: dict[str, list[dict[str, float]]] = {name: [] for name in ARMS}
            for _ in range(args.repeats):
                for name, arm in ARMS.items():
                    samples[name].append(asyncio.run(arm(url, args.requests, in_flight)))
            for name, runs in samples.items():
                rows.append(
                    {
                        "client": name,
                        "in_flight": in_flight,
                        "cpu_ms_per_request": statistics.median(r["cpu_ms_per_request"] for r in runs),
                        "wall_ms_per_request": statistics.median(r["wall_ms_per_request"] for r in runs),
                        "runs": runs,
                    }
                )
    finally:
        server.kill()
        server.wait()

    print("| in flight | httpx (before) CPU ms/request | ServerClient (after) | ratio after/before |")
    print("|---|---|---|---|")
    for in_flight in args.in_flight:
        before, after = (
            next(r for r in rows if r["client"] == name and r["in_flight"] == in_flight)["cpu_ms_per_request"]
            for name in ARMS
        )
        print(f"| {in_flight} | {before:.3f} | {after:.3f} | {after / before:.3f}x |")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        meta = {"requests": args.requests, "repeats": args.repeats, "cpus": os.cpu_count()}
        args.out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
