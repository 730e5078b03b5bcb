"""`run_pipeline serve`: the pipeline plus K HTTP front-end worker processes on one port.
Runs in the CLI's process, which owns the pipeline and the workers and stops them all."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

from ipc.config import ServerOptions
from ipc.errors import ConfigError
from ipc.lora import runtime_updating
from ipc.messages import ForgetClient, SchedulerStats
from ipc.units import parse_bytes
from pipeline.runtime.launcher import Pipeline
from pipeline.runtime.restarts import MAX_RESTARTS, RESTART_WINDOW_S
from pipeline.runtime.supervisor import Report, Supervisor
from pipeline.server.reasoning import PARSERS, check_parser, tags_survive
from pipeline.server.worker import listening_socket, ready_file, run_api_worker

WORKER_READY_TIMEOUT_S = 60.0
# After a stage dies, /health answers 503 (naming it) and requests get errors for this long,
# so load balancers see it; then serve exits non-zero, so a process supervisor sees it too.
ENGINE_FAILURE_GRACE_S = 2.0


def server_options(args: argparse.Namespace) -> ServerOptions:
    if args.api_workers < 1:
        raise ConfigError("--api-workers must be at least 1")
    lora_updating = runtime_updating(args.enable_lora_updating)
    if lora_updating and args.api_workers > 1:
        raise ConfigError(f"--enable-lora-updating takes one API worker, not --api-workers "
                          f"{args.api_workers}: the adapters loaded at run time are known to "
                          "the worker that loaded them")
    return ServerOptions(
        host=args.host, port=args.port, api_key=args.api_key,
        api_workers=args.api_workers, max_body_bytes=parse_bytes(args.max_body_bytes),
        rate_limit_rps=args.rate_limit_rps, rate_limit_concurrent=args.rate_limit_concurrent,
        max_waiting=args.max_waiting, access_log=args.access_log,
        stats_interval=args.stats_interval, tool_call_parser=args.tool_call_parser,
        allowed_origins=tuple(o.strip() for o in args.allowed_origins.split(",") if o.strip()),
        reasoning_parser=check_parser(args.reasoning_parser),
        lora_updating=lora_updating, max_lora_rank=args.max_lora_rank)


def check_reasoning_tags(model_dir: str, name: str) -> None:
    """Refuse to serve a reasoning parser whose tags the model's answers would not show."""
    from transformers import AutoTokenizer

    why = tags_survive(AutoTokenizer.from_pretrained(model_dir), PARSERS[name])
    if why is not None:
        raise ConfigError(why)


def run_serve(pipe: Pipeline, args: argparse.Namespace) -> int:
    options = server_options(args)
    if options.reasoning_parser is not None:
        check_reasoning_tags(pipe.cfg.model.path, options.reasoning_parser)
    run_dir = pipe.cfg.run_dir
    metrics_dir = Path(run_dir) / "metrics"
    metrics_dir.mkdir()
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = str(metrics_dir)  # inherited by the workers
    try:
        sock = listening_socket(options.host, options.port)
    except OSError as exc:
        raise ConfigError(f"cannot listen on {options.host}:{options.port}: {exc}") from None
    options = dataclasses.replace(options, port=sock.getsockname()[1])
    workers = Supervisor()  # the HTTP workers, "api:<rank>"
    names = [f"api:{rank}" for rank in range(options.api_workers)]
    for rank, name in enumerate(names):
        workers.start(name, run_api_worker, run_dir, options, pipe.cfg.model.vocab_size, rank,
                      os.getpid(), sock, pipe.cfg.model.path)
    stats = EngineStatsLog(options.stats_interval)
    try:
        workers.wait_ready(names, _ready_files(run_dir, len(names)), WORKER_READY_TIMEOUT_S)
        host = f"[{options.host}]" if ":" in options.host else options.host
        print(f"serving {pipe.cfg.model_name} at http://{host}:{options.port}/v1 "
              f"({options.api_workers} API worker(s); pipeline run dir {run_dir})", flush=True)
        while True:  # until a signal (SIGTERM/SIGINT end the CLI), or a stage dies
            for name in workers.watch(0.25):  # (and starts those due to restart)
                code = workers.procs[name].exitcode
                delay = workers.restart_later(name)
                if delay is None:
                    print(f"error: API worker {name} exited {MAX_RESTARTS + 1} times within "
                          f"{RESTART_WINDOW_S:.0f} s (last code {code}); stopping",
                          file=sys.stderr)
                    return 1
                print(f"warning: API worker {name} exited (code {code}); its open "
                      f"connections are closed, its requests aborted; starting it again in "
                      f"{delay:.1f} s", file=sys.stderr, flush=True)
                _forget_worker(run_dir, int(name.split(":")[1]), pipe)
            stats.maybe_log(pipe.scheduler_stats)
            if pipe.failure is not None:
                time.sleep(ENGINE_FAILURE_GRACE_S)
                print(f"error: {pipe.failure}; stopping", file=sys.stderr)
                return 1
    finally:
        sock.close()
        workers.stop()


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


def _ready_files(run_dir: str, num_workers: int) -> Callable[[int], Report | None]:
    """The supervisor's reports of the HTTP workers: one is ready once its ready file exists
    (it writes it when it listens, with its reply address)."""
    seen: set[int] = set()

    def reports(wait_ms: int) -> Report | None:
        for rank in range(num_workers):
            if rank not in seen and ready_file(run_dir, rank).exists():
                seen.add(rank)
                return Report(f"api:{rank}")
        time.sleep(wait_ms / 1000)
        return None
    return reports
