"""The scheduler's host work per step, measured alone in this process (issue 52: between a
step's end on the device and the launch of the step after next, everything must fit inside
one device step). The Scheduler core drives a fake device over real shared rings, in the
scheduler process's order: read the sampled ring and `on_sampled`, `schedule` and write the
step into its ring slot, then the shell's `_flush_outputs` (take_outputs, the DetokBatch
messages, their encoding). Steady decode: every sequence decodes one token a step.

    ./scripts/bench host [--batch 64 256] [--steps 1000] [--clock wall|cpu]
                      [--profile FILE] [--json FILE]
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import random
import statistics
import sys
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ipc.codec import encode
from ipc.config import EngineLimits
from ipc.messages import Message, SamplingParams, TokenizedRequest
from ipc.shm import SharedRing
from ipc.step import read_sampled, sampled_specs, step_input_specs
from stages.scheduler.core import Scheduler
from stages.scheduler.planned import PlannedStep
from stages.scheduler.process import SchedulerShell
from stages.trace import Tracer

PARTS = ("on_sampled", "schedule", "write", "outputs")


class _Detokenizers:
    """Stands in for the shell's Peers: one detokenizer, and each message encoded as the
    channel would encode it, then dropped."""

    def __init__(self) -> None:
        self.num_bytes = 0

    def to_detokenizer(self, rank: int, msg: Message) -> bool:
        self.num_bytes += len(encode(msg))
        return True

    def detokenizer_up(self, rank: int) -> bool:
        return True

    def detokenizers_for(self, reply_to: str) -> list[int]:
        return [0]


def bare_shell(core: Scheduler, peers: Any) -> SchedulerShell:
    """A SchedulerShell around `core` with no sockets, whose detokenizers are `peers` (as
    stages.peers.Peers: to_detokenizer, detokenizer_up, detokenizers_for): only its
    _flush_outputs may run."""
    shell = SchedulerShell.__new__(SchedulerShell)
    shell.core, shell.incarnation, shell.tracer = core, 0, Tracer(None, "scheduler", 0)
    shell.cfg = argparse.Namespace(engine=0)  # type: ignore[assignment]
    shell.peers = peers
    shell._pins, shell._unpin = {}, deque()
    return shell


@dataclass
class _Engine:
    """A Scheduler core inside a shell that has no sockets, over rings of its own."""

    core: Scheduler
    shell: SchedulerShell
    steps: SharedRing
    sampled: SharedRing
    rng: random.Random
    inflight: deque[PlannedStep] = field(default_factory=deque)

    @classmethod
    def make(cls, limits: EngineLimits, num_blocks: int, seed: int) -> _Engine:
        core = Scheduler(limits, num_blocks)
        shell = bare_shell(core, _Detokenizers())
        name = f"bench-host-{os.getpid()}-{seed}"
        steps = SharedRing(f"{name}-s", step_input_specs(limits), limits.num_ring_slots,
                           create=True)
        sampled = SharedRing(f"{name}-t", sampled_specs(limits), limits.num_ring_slots,
                             create=True)
        steps.unlink()  # (the mappings stay: nothing is left in /dev/shm if this dies)
        sampled.unlink()
        return cls(core, shell, steps, sampled, random.Random(seed))

    def device(self, step: PlannedStep) -> int:
        """The fake device samples step's rows (never EOS) into its sampled-ring slot."""
        n = len(step.sampled_rows)
        ids = [self.rng.randrange(10, self.core.limits.vocab_size) for _ in range(n)]
        self.sampled.slot(step.ring_slot)["token_ids"][:n] = ids
        return n


def _is_steady(step: PlannedStep, batch: int) -> bool:
    return len(step.rows) == batch and all(len(r.token_ids) == 1 for r in step.rows)


def run(batch: int, num_steps: int, prompt_len: int = 128, output_len: int = 200,
        seed: int = 0, profile: cProfile.Profile | None = None,
        clock: Callable[[], float] = time.perf_counter) -> dict[str, list[float]]:
    """Seconds each part took, one entry per steady step (until num_steps of them): rounds
    of `batch` requests run to their end; a step counts when the step reported back was
    `batch` decoding rows. clock: time.perf_counter (wall), or time.thread_time (this
    thread's CPU time: on a shared host, without the time slices other processes took)."""
    limits = EngineLimits(batch, max(2048, batch), 16, 4096, 32000, (2,), 2)
    per_seq = -(-(prompt_len + output_len) // limits.block_size) + 1
    eng = _Engine.make(limits, batch * per_seq + 64, seed)
    core, shell, rng = eng.core, eng.shell, eng.rng
    times: dict[str, list[float]] = {p: [] for p in PARTS}
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    round_no = 0
    while len(times["schedule"]) < num_steps:
        for i in range(batch):
            prompt = [rng.randrange(10, limits.vocab_size) for _ in range(prompt_len)]
            core.add_request(TokenizedRequest(f"r{round_no}-{i}", "client", prompt, params,
                                              time.time()))
        round_no += 1
        while core.requests and len(times["schedule"]) < num_steps:
            t = [clock()]
            if core.inflight:
                step = core.inflight[0]
                n = eng.device(step)
                if profile:
                    profile.enable()
                t[0] = clock()
                ring = eng.sampled.slot(step.ring_slot)
                ids, logprobs = read_sampled(ring, n, -1)
                core.on_sampled(step.step_id, ids, logprobs)
            else:
                step = None
                if profile:
                    profile.enable()
            t.append(clock())
            planned = core.schedule()
            t.append(clock())
            if planned is not None:
                planned.write(eng.steps.slot(planned.ring_slot))
            t.append(clock())
            shell._flush_outputs()
            t.append(clock())
            if profile:
                profile.disable()
            if planned is not None and len(core.inflight) < limits.max_inflight:
                planned = core.schedule()  # (a fresh engine fills the pipe)
                if planned is not None:
                    planned.write(eng.steps.slot(planned.ring_slot))
            if step is not None and _is_steady(step, batch):
                for part, a, b in zip(PARTS, t, t[1:], strict=False):
                    times[part].append(b - a)
    return times


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def summary(times: dict[str, list[float]]) -> dict[str, Any]:
    """Median and p99 of each part and of their sum per step, in ms."""
    total = [sum(parts) for parts in zip(*times.values(), strict=True)]
    out: dict[str, Any] = {}
    for name, values in (*times.items(), ("total", total)):
        out[name] = {"median_ms": round(statistics.median(values) * 1e3, 4),
                     "p99_ms": round(_percentile(values, 0.99) * 1e3, 4)}
    out["steps"] = len(total)
    return out


def add_host_parser(sub: Any) -> None:
    p = sub.add_parser("host", help="the scheduler's host work per step, in process")
    p.add_argument("--batch", type=int, nargs="+", default=[64, 256])
    p.add_argument("--steps", type=int, default=1000, help="steady steps timed per batch")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=200)
    p.add_argument("--profile", help="write a cProfile of the timed parts here "
                   "(one file per batch: FILE.<batch>); timings then include its cost")
    p.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                   help="cpu: the thread's CPU time, without other processes' time "
                   "slices (a shared host)")
    p.add_argument("--json", help="write the summary here too")
    p.set_defaults(func=host)


def host(args: argparse.Namespace) -> int:
    results = {}
    for batch in args.batch:
        prof = cProfile.Profile() if args.profile else None
        clock = time.thread_time if args.clock == "cpu" else time.perf_counter
        times = run(batch, args.steps, args.prompt_len, args.output_len, profile=prof,
                    clock=clock)
        results[batch] = summary(times)
        line = "  ".join(f"{k} {v['median_ms']:.3f}/{v['p99_ms']:.3f}"
                         for k, v in results[batch].items() if isinstance(v, dict))
        print(f"batch {batch} ({results[batch]['steps']} steps, {args.clock} ms median/p99): "
              f"{line}")
        if prof is not None:
            prof.dump_stats(f"{args.profile}.{batch}")
            pstats.Stats(prof, stream=sys.stdout).sort_stats("tottime").print_stats(25)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({str(b): r for b, r in results.items()}, f, indent=1)
    return 0
