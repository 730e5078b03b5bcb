"""`run_pipeline serve`: the pipeline plus K HTTP front-end worker processes on one port.
Runs in the CLI's process, which owns the pipeline and the workers and stops them all."""

from __future__ import annotations

import argparse
import dataclasses
import json
import multiprocessing as mp
import os
import sys
import time
from multiprocessing.connection import wait
from pathlib import Path

from ipc.errors import ConfigError
from ipc.messages import ForgetClient, SchedulerStats
from ipc.units import parse_bytes
from pipeline.runtime.launcher import Pipeline, StartupError
from pipeline.runtime.restarts import MAX_RESTARTS, RESTART_WINDOW_S, RestartPolicy
from pipeline.server.app import ServerOptions
from pipeline.server.worker import listening_socket, ready_file, run_api_worker

WORKER_READY_TIMEOUT_S = 60.0
# After a stage dies, /health answers 503 (naming it) and requests get errors for this long,
# so load balancers see it; then serve exits non-zero, so a process supervisor sees it too.
ENGINE_FAILURE_GRACE_S = 2.0


def server_options(args: argparse.Namespace) -> ServerOptions:
    if args.api_workers < 1:
        raise ConfigError("--api-workers must be at least 1")
    return ServerOptions(
        host=args.host, port=args.port, api_key=args.api_key,
        api_workers=args.api_workers, max_body_bytes=parse_bytes(args.max_body_bytes),
        rate_limit_rps=args.rate_limit_rps, rate_limit_concurrent=args.rate_limit_concurrent,
        max_waiting=args.max_waiting, access_log=args.access_log,
        allowed_origins=tuple(o.strip() for o in args.allowed_origins.split(",") if o.strip()))


def run_serve(pipe: Pipeline, args: argparse.Namespace) -> int:
    options = server_options(args)
    run_dir = pipe.cfg.run_dir
    metrics_dir = Path(run_dir) / "metrics"
    metrics_dir.mkdir()
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = str(metrics_dir)  # inherited by the workers
    try:
        sock = listening_socket(options.host, options.port)
    except OSError as exc:
        raise ConfigError(f"cannot listen on {options.host}:{options.port}: {exc}") from None
    options = dataclasses.replace(options, port=sock.getsockname()[1])
    ctx = mp.get_context("spawn")

    def start_worker(rank: int) -> mp.process.BaseProcess:
        w = ctx.Process(target=run_api_worker, name=f"llm-pipeline:api:{rank}",
                        args=(run_dir, options, pipe.cfg.model.vocab_size, rank, os.getpid(),
                              sock, pipe.cfg.model.path))
        w.start()
        return w

    workers = [start_worker(rank) for rank in range(options.api_workers)]
    restarts = RestartPolicy()
    due: dict[int, float] = {}  # rank -> when to start the dead worker again
    stats = EngineStatsLog(args.stats_interval)
    try:
        _wait_ready(workers, run_dir)
        host = f"[{options.host}]" if ":" in options.host else options.host
        print(f"serving {pipe.cfg.model_name} at http://{host}:{options.port}/v1 "
              f"({options.api_workers} API worker(s); pipeline run dir {run_dir})", flush=True)
        while True:  # until a signal (SIGTERM/SIGINT end the CLI), or a stage dies
            watched = [w.sentinel for rank, w in enumerate(workers) if rank not in due]
            if watched:
                wait(watched, timeout=0.25)
            else:
                time.sleep(0.25)
            for rank, w in enumerate(workers):
                if w.is_alive() or rank in due:
                    continue
                delay = restarts.delay(f"api:{rank}")
                if delay is None:
                    print(f"error: API worker {rank} exited {MAX_RESTARTS + 1} times within "
                          f"{RESTART_WINDOW_S:.0f} s (last code {w.exitcode}); stopping",
                          file=sys.stderr)
                    return 1
                print(f"warning: API worker {rank} exited (code {w.exitcode}); its open "
                      f"connections are closed, its requests aborted; starting it again in "
                      f"{delay:.1f} s", file=sys.stderr, flush=True)
                _forget_worker(run_dir, rank, pipe)
                due[rank] = time.monotonic() + delay
            for rank, when in list(due.items()):
                if time.monotonic() >= when:
                    del due[rank]
                    workers[rank] = start_worker(rank)
            stats.maybe_log(pipe.scheduler_stats)
            if pipe.failure is not None:
                time.sleep(ENGINE_FAILURE_GRACE_S)
                print(f"error: {pipe.failure}; stopping", file=sys.stderr)
                return 1
    finally:
        sock.close()
        for w in workers:
            if w.is_alive():
                w.terminate()
        for w in workers:
            w.join(10)
            if w.is_alive():
                w.kill()
                w.join(5)


class EngineStatsLog:
    """Every `interval` seconds (0: never), one line of what the engine did meanwhile, as
    vLLM prints it: prompt and generation throughput, running and waiting sequences, KV cache
    use, prefix-cache hit rate, device idle."""

    def __init__(self, interval: float) -> None:
        self.interval = interval
        self._last: tuple[float, SchedulerStats] | None = None

    def maybe_log(self, stats: SchedulerStats | None) -> None:
        now = time.monotonic()
        if self.interval <= 0 or stats is None:
            return
        if self._last is None:
            self._last = (now, stats)
            return
        then, before = self._last
        if now - then < self.interval:
            return
        self._last = (now, stats)
        print(self.line(before, stats, now - then), file=sys.stderr, flush=True)

    @staticmethod
    def line(before: SchedulerStats, now: SchedulerStats, seconds: float) -> str:
        queries = now.prefix_cache_queries - before.prefix_cache_queries
        hits = now.prefix_cache_hits - before.prefix_cache_hits
        used = 1 - now.num_free_blocks / now.num_blocks if now.num_blocks else 0.0
        prompt = (now.prompt_tokens - before.prompt_tokens) / seconds
        generation = (now.generation_tokens - before.generation_tokens) / seconds
        return (f"engine: prompt {prompt:.1f} tok/s, generation {generation:.1f} tok/s, "
                f"running {now.num_running}, waiting {now.num_waiting}, KV cache "
                f"{used:.1%}, prefix-cache hits {hits / queries if queries else 0.0:.1%}, device "
                f"idle {now.device_idle_fraction:.1%}")


def _forget_worker(run_dir: str, rank: int, pipe: Pipeline) -> None:
    """A dead worker's requests would run on for nobody: the scheduler aborts them (by the
    reply address its ready file names) and refuses any still on their way."""
    path = ready_file(run_dir, rank)
    try:
        reply_to = json.loads(path.read_text())["reply_to"]
    except (OSError, ValueError, KeyError):
        return  # it died before it was ready: it had sent nothing
    path.unlink()
    pipe.tell_engines(ForgetClient(reply_to))  # every engine serving


def _wait_ready(workers: list[mp.process.BaseProcess], run_dir: str) -> None:
    deadline = time.monotonic() + WORKER_READY_TIMEOUT_S
    while not all(ready_file(run_dir, r).exists() for r in range(len(workers))):
        dead = [w for w in workers if not w.is_alive()]
        if dead:
            raise StartupError(f"API worker {dead[0].name} exited with code {dead[0].exitcode} "
                               "before it was ready (is the port free?)")
        if time.monotonic() > deadline:
            raise StartupError("the API workers did not start in time")
        time.sleep(0.05)
