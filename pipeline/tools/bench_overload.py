"""`scripts/bench overload`: many HTTP requests at once against `run_pipeline serve`, as an
overloaded service sees them. Reports, per HTTP status, how many and how fast (p50/p99 of the
time to the answer: refusals must be fast), and the API workers' memory before, at the peak
and after each round (it must come back, not grow round after round)."""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import socket
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np
import psutil

from ipc.config import SchedulerConfig

ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    """A TCP port of 127.0.0.1 free a moment ago (for a server a benchmark starts)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _workers_rss(proc: subprocess.Popen[str]) -> int:
    """Bytes resident in the API worker processes of a serve process tree."""
    total = 0
    for child in psutil.Process(proc.pid).children(recursive=True):
        try:
            if "llm-pipeline:api:" in " ".join(child.cmdline()):
                total += child.memory_info().rss
        except psutil.Error:
            pass
    return total


async def _post(host: str, port: int, request: bytes) -> str:
    """One HTTP/1.1 request on its own connection; the status code (or the error's name).
    Raw asyncio streams, not an HTTP library: the generator must not be what is slow."""
    try:
        reader, writer = await asyncio.open_connection(host, port)
    except OSError as exc:
        return type(exc).__name__
    try:
        writer.write(request)
        await writer.drain()
        status = await reader.readline()
        length = 0
        while (line := await reader.readline()) not in (b"\r\n", b""):
            name, _, value = line.decode("latin-1").partition(":")
            if name.lower() == "content-length":
                length = int(value)
        await reader.readexactly(length)
        return status.split()[1].decode() if len(status.split()) > 1 else "no-status"
    except (OSError, asyncio.IncompleteReadError) as exc:
        return type(exc).__name__
    finally:
        writer.close()


async def _round(url: str, model: str, num: int, max_tokens: int) -> dict[str, list[float]]:
    host, port = url.removeprefix("http://").split(":")
    body = json.dumps({"model": model, "prompt": "Tell me a story about the sea",
                       "max_tokens": max_tokens, "ignore_eos": True}).encode()
    request = (f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\n"
               f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
               "Connection: close\r\n\r\n").encode() + body
    latencies: dict[str, list[float]] = defaultdict(list)

    async def one() -> None:
        start = time.monotonic()
        key = await _post(host, int(port), request)
        latencies[key].append(time.monotonic() - start)

    await asyncio.gather(*(one() for _ in range(num)))
    return latencies


async def _watched(work: Any, sample: Any) -> Any:
    """Await `work`, calling sample() every 0.2 s meanwhile."""
    task = asyncio.ensure_future(work)
    while not task.done():
        sample()
        await asyncio.sleep(0.2)
    return await task


def overload(args: argparse.Namespace) -> int:
    port = free_port()
    cmd = [str(ROOT / "scripts" / "run_pipeline"), "--device", args.device,
           "--max-num-seqs", str(args.max_num_seqs), "serve", "--port", str(port),
           "--api-workers", str(args.api_workers), "--max-waiting", str(args.max_waiting),
           *(["--rate-limit-concurrent", str(args.rate_limit_concurrent)]
             if args.rate_limit_concurrent else [])]
    if args.model:
        cmd[1:1] = ["--model", args.model]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    rounds = []
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            if line.startswith("serving "):
                model = line.split()[1]
                break
        else:
            raise SystemExit(f"serve exited with {proc.wait()}")
        url = f"http://127.0.0.1:{port}"
        asyncio.run(_round(url, model, 8, 2))  # warm up: what one request loads is no burst's
        time.sleep(args.settle_s)
        print(json.dumps({"baseline_rss_mib": _workers_rss(proc) / 2**20}), flush=True)
        for i in range(args.rounds):
            before = _workers_rss(proc)
            peak = [before]
            lat = asyncio.run(_watched(_round(url, model, args.num_requests, args.max_tokens),
                                       lambda p=peak: p.append(_workers_rss(proc))))
            time.sleep(args.settle_s)
            after = _workers_rss(proc)
            result: dict[str, Any] = {"round": i, "rss_before_mib": before / 2**20,
                                      "rss_peak_mib": max(peak) / 2**20,
                                      "rss_after_mib": after / 2**20, "status": {}}
            for key, values in sorted(lat.items()):
                a = np.array(values)
                result["status"][key] = {"count": len(values),
                                         "p50_s": float(np.percentile(a, 50)),
                                         "p99_s": float(np.percentile(a, 99))}
            rounds.append(result)
            print(json.dumps(result), flush=True)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
    if args.json:
        Path(args.json).write_text(json.dumps({"command": sys.argv, "rounds": rounds}, indent=1))
    return 0


def add_overload_parser(sub: Any) -> None:
    p = sub.add_parser("overload", help="many HTTP requests at once: refusal latency, memory")
    p.add_argument("--model", default=None)
    p.add_argument("--device", default="timed:5,0")
    p.add_argument("--num-requests", type=int, default=3000)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--max-num-seqs", type=int, default=SchedulerConfig.max_num_seqs)
    # Below serve's own (SERVE_MAX_WAITING): the queue fills, and refusals start, sooner.
    p.add_argument("--max-waiting", type=int, default=256)
    p.add_argument("--api-workers", type=int, default=1)
    p.add_argument("--rate-limit-concurrent", type=int, default=0)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--settle-s", type=float, default=5.0, help="idle time before 'after'")
    p.add_argument("--json", default=None, metavar="FILE")
    p.set_defaults(func=overload)
