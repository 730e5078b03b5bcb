"""The scheduler core driving a real runner and its device (CpuDevice, CudaDevice) over real
shared rings, in one process: the executor's host loop, streams, events, page-locked rings
and notifier exactly as the stage runs them, without sockets. For the GPU check
(pipeline/tools/gpu_check.py) and its tests on the CPU.

`sync=True` waits for each step's report before the next is planned; otherwise the
scheduler runs ahead as the pipeline does. Both make the same calls to the scheduler in the
same order (a step's results are always taken after the steps planned before them), so the
same requests must give bit-identical outputs either way: any difference is a race in the
device's stream and event protocol. `slow_cycles` makes the device artificially slow
(`torch.cuda._sleep` on each of its streams every step), so that the host really runs ahead.
"""

from __future__ import annotations

import os
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from ipc.config import EngineLimits
from ipc.messages import SamplingParams, TokenizedRequest
from ipc.outputs import SampleResult
from ipc.params import MAX_TOP_LOGPROBS
from ipc.shm import SharedRing
from ipc.speculative import SpeculativeConfig
from ipc.step import (
    read_accepted,
    read_prompt_logprobs,
    read_sampled,
    sampled_specs,
    step_input_specs,
)
from stages.executor.device import Device, make_device
from stages.executor.runner import Runner
from stages.executor.step_inputs import HostStep
from stages.scheduler.core import Scheduler
from stages.trace import now_ns

Requests = list[tuple[str, list[int], SamplingParams]]


@dataclass
class RunStats:
    steps: int = 0
    submit_ns: list[int] = field(default_factory=list)  # host time in device.submit per step
    device: list[tuple[int, int, int]] = field(default_factory=list)  # (tokens, t0, t1)
    preemptions: int = 0
    draft_tokens: int = 0  # proposed (with speculative=)
    accepted_tokens: int = 0


class DeviceRun:
    """One runner and its rings; each run() has a device of its own (a device serves once)."""

    def __init__(self, runner: Runner, limits: EngineLimits) -> None:
        self.runner, self.limits = runner, limits
        base = f"llmp-devrun-{os.getpid()}-{id(self):x}"
        n = limits.num_ring_slots
        self.steps = SharedRing(base + "-in", step_input_specs(limits), n, create=True)
        self.sampled = SharedRing(base + "-out", sampled_specs(limits), n, create=True)
        self.steps.unlink()  # mapped: the names can go now, nothing outlives the process
        self.sampled.unlink()
        self._done: queue.SimpleQueue[tuple[Any, ...]] = queue.SimpleQueue()
        self.device: Device | None = None

    def _on_done(self, step: HostStep, num_sampled: int, has_logprobs: bool,
                 num_prompt_logprobs: int, t0: int, t1: int) -> None:
        self._done.put((step, num_sampled, has_logprobs, num_prompt_logprobs, t0, t1))

    def run(self, requests: Requests, *, sync: bool = False, slow_cycles: int = 0,
            before_submit: Callable[[HostStep], None] | None = None,
            speculative: SpeculativeConfig | None = None
            ) -> tuple[dict[tuple[str, int], SampleResult], RunStats]:
        """Run requests to the end; results by (request id, sample index). before_submit:
        called with each step before it is submitted (a profiler's window, say).
        speculative: the scheduler proposes drafts (its K at most the limits'; n-gram: the
        runner here has no draft model)."""
        if speculative is not None and speculative.is_draft_model:
            raise ValueError("the device-run harness drafts by n-gram only")
        scheduler = Scheduler(self.limits, self.runner.num_blocks, speculative=speculative)
        results: dict[tuple[str, int], SampleResult] = {}
        for rid, ids, params in requests:
            scheduler.add_request(TokenizedRequest(rid, "", ids, params, 0.0))
            for i in range(params.n):
                results[rid, i] = SampleResult(i)
        stats = RunStats()
        stop, failure = threading.Event(), []

        def host_loop() -> None:
            try:
                self._drive(scheduler, results, stats, sync, slow_cycles, before_submit)
            except BaseException as exc:
                failure.append(exc)
            finally:
                stop.set()

        self.device = make_device(self.runner, self.sampled, self._on_done)
        try:
            self.device.serve(host_loop, stop)
        finally:
            self.device.close()
        if failure:
            raise failure[0]
        stats.preemptions = scheduler.num_preemptions
        stats.draft_tokens = scheduler.spec_num_draft_tokens
        stats.accepted_tokens = scheduler.spec_num_accepted_tokens
        return results, stats

    def _drive(self, scheduler: Scheduler, results: dict[tuple[str, int], SampleResult],
               stats: RunStats, sync: bool, slow_cycles: int,
               before_submit: Callable[[HostStep], None] | None) -> None:
        inflight = 0
        waiting: list[tuple[Any, ...]] = []  # reports already received (sync mode)
        while scheduler.requests or inflight:
            while (planned := scheduler.schedule()) is not None:
                ring = self.steps.slot(planned.ring_slot)
                step = self.runner.prepare(planned.write(ring), ring)
                if before_submit is not None:
                    before_submit(step)
                if slow_cycles:
                    self._slow_down(slow_cycles)
                start = now_ns()
                assert self.device is not None
                self.device.submit(step)
                stats.submit_ns.append(now_ns() - start)
                inflight += 1
                if sync:  # the device finishes this step before the host plans the next
                    waiting.append(self._next_report())
            report = waiting.pop(0) if waiting else self._next_report()
            step, num_sampled, has_logprobs, num_prompt, t0, t1 = report
            ring = self.sampled.slot(step.plan.ring_slot)
            ids, logprobs = read_sampled(ring, num_sampled,
                                         MAX_TOP_LOGPROBS if has_logprobs else -1)
            drafted = scheduler.inflight[0].num_drafted_rows
            scheduler.on_sampled(step.plan.step_id, ids, logprobs,
                                 read_prompt_logprobs(ring, num_prompt),
                                 read_accepted(ring, drafted) if drafted else None)
            stats.steps += 1
            stats.device.append((step.num_tokens, t0, t1))
            inflight -= 1
            for delta in scheduler.take_outputs().deltas:
                results[delta.request_id, delta.index].add(delta)

    def _next_report(self) -> tuple[Any, ...]:
        while True:
            if self.device is not None and self.device.error is not None:
                raise RuntimeError("the device failed") from self.device.error
            try:
                return self._done.get(timeout=1.0)
            except queue.Empty:
                continue

    def _slow_down(self, cycles: int) -> None:
        """A slow device: each of its streams sleeps before this step's work on it."""
        for name in ("copy_stream", "compute_stream", "d2h_stream"):
            stream = getattr(self.device, name, None)
            if stream is not None:
                with torch.cuda.stream(stream):
                    torch.cuda._sleep(cycles)


def comparable(results: dict[tuple[str, int], SampleResult]) -> dict[tuple[str, int], Any]:
    """What must be bit-identical between two runs of the same requests."""
    def lps(items: list[Any] | None) -> list[Any] | None:
        return None if items is None else [(lp.token_id, lp.logprob, lp.top_ids,
                                            lp.top_logprobs, lp.rank) for lp in items]

    return {key: (r.token_ids, lps(r.logprobs), r.finish_reason, r.stop_reason,
                  lps(r.prompt_logprobs)) for key, r in results.items()}


def same_tokens(a: dict[tuple[str, int], SampleResult],
                b: dict[tuple[str, int], SampleResult]) -> bool:
    """Whether two runs gave every sample the same tokens and finish."""
    return {k: (r.token_ids, r.finish_reason) for k, r in a.items()} == {
        k: (r.token_ids, r.finish_reason) for k, r in b.items()}


def overlap_workload(vocab: int) -> list[tuple[str, list[int], SamplingParams]]:
    """Mixed lengths; greedy, seeded with penalties, min_tokens, logprobs, prompt logprobs."""
    kinds = [SamplingParams(max_tokens=14, temperature=0.0, ignore_eos=True),
             SamplingParams(max_tokens=14, temperature=0.8, seed=11, repetition_penalty=1.2,
                            frequency_penalty=0.3, ignore_eos=True),
             SamplingParams(max_tokens=14, temperature=0.0, min_tokens=6, logprobs=2),
             SamplingParams(max_tokens=10, temperature=0.7, seed=3, top_k=8, top_p=0.9,
                            prompt_logprobs=1, ignore_eos=True)]
    return [(f"r{i}", [(3 + 7 * i + 5 * j) % (vocab - 3) + 3 for j in range(2 + 9 * i % 45)],
             kinds[i % len(kinds)]) for i in range(10)]
