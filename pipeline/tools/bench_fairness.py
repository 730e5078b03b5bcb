"""`scripts/bench fairness`: the starvation probe on the live pipeline. A short request (the
probe: 16 prompt tokens, 8 out; its own sender, or with --same-sender the hog's client and
user, as requests behind one proxy are) is timed alone, then behind each hog: one
request with n = 128; a flood of long prompts; many requests at once; traffic of a better
priority. Reports each wait in seconds and as a multiple of the alone time (the bound is 10x;
`tests/test_fairness.py` checks the same in scheduler steps)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ipc.config import ExecutorConfig, PipelineConfig, SchedulerConfig
from ipc.messages import SamplingParams
from ipc.model_info import ModelInfo
from pipeline.runtime.client import PipelineClient

HAS_USER = "user" in {f.name for f in dataclasses.fields(SamplingParams)}


def _params(user: str, **kwargs: Any) -> SamplingParams:
    return SamplingParams(temperature=0.0, ignore_eos=True,
                          **({"user": user} if HAS_USER else {}), **kwargs)


def _probe(client: PipelineClient, vocab: int, timeout: float, user: str = "probe") -> float:
    start = time.monotonic()
    (out,) = client.generate([[5 + i % (vocab - 5) for i in range(16)]],
                             _params(user, max_tokens=8), timeout=timeout)
    if out.error:
        raise RuntimeError(f"the probe failed: {out.error}")
    return time.monotonic() - start


def _hogs(vocab: int) -> dict[str, Callable[[PipelineClient, threading.Event], None]]:
    def ids(seed: int, n: int) -> list[int]:
        return [5 + (seed * 131 + 7 * j) % (vocab - 5) for j in range(n)]

    def n128(client: PipelineClient, stop: threading.Event) -> None:
        client.generate([ids(1, 32)], _params("hog", max_tokens=400, n=128))

    def long_prompts(client: PipelineClient, stop: threading.Event) -> None:
        sent = []
        i = 0
        while not stop.is_set():  # faster than they are served
            sent.append(client._submit(ids(i, 2000), _params("hog", max_tokens=50), None,
                                       lambda outs: None))
            i += 1
            time.sleep(0.01)
        for rid in sent:
            client.abort(rid)

    def many(client: PipelineClient, stop: threading.Event) -> None:
        client.generate([ids(i, 32) for i in range(256)], _params("hog", max_tokens=200))

    def urgent(client: PipelineClient, stop: threading.Event) -> None:
        sent = [client._submit(ids(i, 32), _params("hog", max_tokens=100, priority=-1), None,
                               lambda outs: None) for i in range(256)]  # a backlog, then more
        i = 256
        while not stop.is_set():
            sent.append(client._submit(ids(i, 32), _params("hog", max_tokens=100, priority=-1),
                                       None, lambda outs: None))
            i += 1
            time.sleep(0.01)
        for rid in sent:
            client.abort(rid)

    return {"n=128": n128, "long prompts": long_prompts, "256 requests": many,
            "urgent traffic": urgent}


def fairness(args: argparse.Namespace) -> int:
    from pipeline.runtime.launcher import Pipeline
    from pipeline.tools.model_source import resolve_model

    model = ModelInfo.from_dir(resolve_model(args.model_dir), 4096)
    sched = SchedulerConfig(max_num_seqs=args.max_num_seqs)
    if "priority_range" in {f.name for f in dataclasses.fields(SchedulerConfig)}:
        sched = dataclasses.replace(sched, priority_range=(-10, 10))
    cfg = PipelineConfig(model=model, scheduler=sched,
                         executor=ExecutorConfig.for_device(args.device, dtype="float32",
                                                            kv_cache_memory=2 << 30))
    results: dict[str, Any] = {"command": "bench fairness", "device": args.device,
                               "same_sender": args.same_sender}
    with Pipeline(cfg) as pipe:
        probe_client, hog_client = pipe.client(), pipe.client()
        user = "probe"
        if args.same_sender:  # one client and one user: one sender to the scheduler
            probe_client, user = hog_client, "hog"
        alone = statistics.median(_probe(probe_client, model.vocab_size, 60, user)
                                  for _ in range(3))
        results["alone_s"] = alone
        print(f"probe alone: {alone:.3f} s", flush=True)
        for name, hog in _hogs(model.vocab_size).items():
            stop = threading.Event()
            thread = threading.Thread(target=hog, args=(hog_client, stop), daemon=True)
            thread.start()
            time.sleep(args.hog_lead_s)  # the hog has filled the engine
            try:
                waited = _probe(probe_client, model.vocab_size, args.timeout_s, user)
            except TimeoutError:
                waited = float("inf")
            stop.set()
            thread.join()
            pipe.idle_stats(timeout=300)
            results[name] = waited
            print(f"behind {name}: {waited:.3f} s ({waited / alone:.1f}x alone)", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


def add_fairness_parser(sub: Any) -> None:
    p = sub.add_parser("fairness", help="the starvation probe behind each kind of hog")
    p.add_argument("--model", dest="model_dir", default=None)
    p.add_argument("--device", default="timed:5,0.01")
    p.add_argument("--max-num-seqs", type=int, default=SchedulerConfig.max_num_seqs)
    p.add_argument("--hog-lead-s", type=float, default=2.0)
    p.add_argument("--timeout-s", type=float, default=120.0)
    p.add_argument("--same-sender", action="store_true",
                   help="send the probe as the hog's own client and user")
    p.add_argument("--json", default=None, metavar="FILE")
    p.set_defaults(func=fairness)
