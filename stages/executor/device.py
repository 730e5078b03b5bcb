"""Where steps run, in the executor process. The host loop prepares step N+1 while the device
runs step N; each device reports a finished step with its busy interval. Each device owns its
threads: `serve(host_loop, stop)` runs the host loop where that device wants it, and
`make_device` is the one place that picks the device for a runner.

CpuDevice: the CPU: the main thread executes queued steps in order while a host thread runs
the host loop (PyTorch releases the GIL inside kernels); completion flags are the queue itself.
TimedDevice: the timed instrument, shaped like CUDA's: the host loop launches each step on the
main thread (paying the launch's host time), the step occupies a device timeline of its own,
and a notifier thread reports it when that timeline says it ended.
CudaDevice: the host loop runs on the main thread and launches each step on copy, compute and
device->host streams ordered by CUDA events; the staging buffers and the sampled-token ring are
page-locked; a notifier thread waits on each step's last event, never the host loop. A step's
results come back in one copy per row kind (`pack_outputs`), its events come from pools, and
its device interval from its own events (`StepClock`).
"""

from __future__ import annotations

import ctypes
import logging
import queue
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any, Protocol

import numpy as np
import torch

from ipc.shm import SharedRing
from stages.executor.parallel import PipelineParallel
from stages.executor.pooling import vector_bytes
from stages.executor.runner import Runner, TimedRunner
from stages.executor.sampler import SampleOutput
from stages.executor.step_inputs import HostStep
from stages.trace import now_ns

logger = logging.getLogger(__name__)

# (step, num_sampled, has_logprobs, num_prompt_logprobs, device_start_ns, device_end_ns); the
# ids (and logprobs) are already in the step's sampled-token ring slot.
OnDone = Callable[[HostStep, int, bool, int, int, int], None]


# A computed step on its way to the report: (step, result, device start ns, device end ns).
Done = tuple[HostStep, SampleOutput, int, int]


HostLoop = Callable[[], None]  # receives plans and submit()s them until told to stop


class Device(Protocol):
    """Runs a runner's steps in submission order and reports each with on_done."""

    error: BaseException | None  # set when the device's own thread failed

    def serve(self, host_loop: HostLoop, stop: threading.Event) -> None: ...

    def submit(self, step: HostStep) -> None: ...

    def close(self) -> None: ...


def make_device(runner: Runner, sampled: SharedRing, on_done: OnDone) -> Device:
    """The device that runs `runner`'s steps: CUDA streams for a CUDA runner, else the CPU."""
    if runner.device.type == "cuda":
        return CudaDevice(runner, sampled, on_done)
    if isinstance(runner, TimedRunner):
        return TimedDevice(runner, sampled, on_done)
    return CpuDevice(runner, sampled, on_done)


def _row_groups(out: SampleOutput) -> list[list[tuple[str, torch.Tensor]]]:
    """The (ring field, tensor) pairs a step's result fills in the sampled-token ring, in
    groups of one row count: the sampled positions, the rows with drafts if any (how many of
    their positions stand), then the scored prompt positions if any."""
    sampled = [("token_ids", out.tokens)]
    if out.logprob is not None and out.top_ids is not None and out.top_logprobs is not None:
        sampled += [("logprob", out.logprob), ("top_ids", out.top_ids),
                    ("top_logprobs", out.top_logprobs)]
    groups = [sampled]
    if out.accepted is not None:
        groups.append([("num_accepted", out.accepted)])
    if out.prompt is not None:
        groups.append([("plp_logprob", out.prompt.logprob), ("plp_rank", out.prompt.rank),
                       ("plp_top_ids", out.prompt.top_ids),
                       ("plp_top_logprobs", out.prompt.top_logprobs)])
    return groups


def _group_of(field: str) -> str:
    """Which packed group a sampled-ring field travels in (named by the group's first)."""
    if field.startswith("plp_"):
        return "plp_logprob"
    return field if field == "num_accepted" else "token_ids"


def _with_logprobs(out: SampleOutput) -> list[tuple[str, torch.Tensor]]:
    return [pair for group in _row_groups(out) for pair in group]


# A packed group: its bytes [rows, row bytes] and, per field, (ring field, dtype, row shape).
PackedRows = tuple[torch.Tensor, list[tuple[str, np.dtype, tuple[int, ...]]]]


def pack_outputs(out: SampleOutput) -> list[PackedRows]:
    """The step's result as one byte matrix per row kind (one row per sampled row, one per
    scored prompt position), so that it comes back from the device in one copy each instead
    of one per field. Device work: one concatenation, none for plain tokens."""
    packed = []
    for group in _row_groups(out):
        rows = len(group[0][1])
        if not rows:  # (a step of prompt chunks that samples nothing)
            continue
        columns = [t.contiguous().view(rows, -1).view(torch.uint8) for _, t in group]
        data = columns[0] if len(columns) == 1 else torch.cat(columns, dim=1)
        packed.append((data, [(name, np.dtype(str(t.dtype).removeprefix("torch.")),
                               tuple(t.shape[1:])) for name, t in group]))
    return packed


def unpack_outputs(data: np.ndarray, fields: list[tuple[str, np.dtype, tuple[int, ...]]],
                   ring: dict[str, np.ndarray]) -> None:
    """Write a packed group's bytes [rows, row bytes] (host memory) into its ring fields."""
    rows, offset = data.shape[0], 0
    for name, dtype, shape in fields:
        width = dtype.itemsize * int(np.prod(shape, dtype=np.int64))
        ring[name][:rows] = data[:, offset:offset + width].view(dtype).reshape(rows, *shape)
        offset += width


def write_ring(ring: dict[str, np.ndarray], out: SampleOutput) -> tuple[int, bool, int]:
    """Write a step's result (host tensors) into its sampled-ring slot; returns _counts.
    (A notifier runs it between a step's end and its report: a step of plain tokens, the
    steady state, writes its one field without building the field list.)"""
    tokens = out.tokens
    if out.logprob is None and out.accepted is None and out.prompt is None:
        n = len(tokens)
        ring["token_ids"][:n] = tokens.numpy()
        return n, False, 0
    for name, tensor in _with_logprobs(out):
        ring[name][: len(tensor)] = tensor.numpy()
    return _counts(out)


def _counts(out: SampleOutput) -> tuple[int, bool, int]:
    """(sampled ids, whether with logprobs, prompt logprobs) of a step's result."""
    return (len(out.tokens), out.logprob is not None,
            len(out.prompt.logprob) if out.prompt is not None else 0)


class CpuDevice:
    """Runs queued steps in order on the process's main thread, because PyTorch's CPU kernels
    ran 15-25% slower when called from another thread here (measured on the limit loop); the
    host loop runs on a second thread."""

    def __init__(self, runner: Runner, sampled: SharedRing, on_done: OnDone) -> None:
        self.runner, self.sampled, self.on_done = runner, sampled, on_done
        self.error: BaseException | None = None
        self._queue: queue.SimpleQueue[HostStep | None] = queue.SimpleQueue()
        # Reports leave from their own thread, so the device starts its next step at once.
        self._done: queue.SimpleQueue[Done | None] = queue.SimpleQueue()
        self._reporter = threading.Thread(target=self._report, name="report", daemon=True)
        self._reporter.start()

    def submit(self, step: HostStep) -> None:
        self._queue.put(step)

    def serve(self, host_loop: HostLoop, stop: threading.Event) -> None:
        """Run host_loop on a thread and the steps it submits here, until stop is set."""
        failure: list[BaseException] = []

        def host() -> None:
            try:
                host_loop()
            except BaseException as exc:
                failure.append(exc)
                stop.set()

        thread = threading.Thread(target=host, name="host", daemon=True)
        thread.start()
        try:
            self.run(stop, thread)
        except BaseException:
            stop.set()
            raise
        finally:
            thread.join(timeout=5)
        if failure:
            raise RuntimeError("the executor's host loop failed") from failure[0]

    def run(self, stop: threading.Event, host: threading.Thread | None = None) -> None:
        """Execute submitted steps until close() is called, or until stop is set, the host
        loop (`host`) has ended and every step it submitted has run: a tensor-parallel rank
        must run each step its peers run, or they wait in a collective for it."""
        try:
            while True:
                try:
                    step = self._queue.get(timeout=0.1)
                except queue.Empty:
                    if stop.is_set() and (host is None or not host.is_alive()):
                        return
                    continue
                if step is None:
                    return
                start = now_ns()
                out = self.runner.compute(step, step.packed)
                self._done.put((step, out, out.began_ns or start, now_ns()))
                if self._queue.empty():  # no step to run next yet: run what it will want
                    self.runner.work_ahead(lambda: not self._queue.empty())
        finally:
            self._done.put(None)

    def _report(self) -> None:
        try:
            report_steps(self._done, self.sampled, self.on_done)
        except BaseException as exc:
            logger.exception("report thread failed")
            self.error = exc

    def close(self) -> None:
        self._queue.put(None)
        self._done.put(None)
        self._reporter.join(timeout=30)


def report_steps(done: queue.SimpleQueue[Done | None], sampled: SharedRing, on_done: OnDone,
                 at_end: bool = False) -> None:
    """Until None comes: write each step's result into its sampled-ring slot and report it
    (at_end: not before its device end, on the timed instrument's clock)."""
    while (item := done.get()) is not None:
        step, out, start, end = item
        if at_end and (wait := (end - now_ns()) / 1e9) > 0:
            time.sleep(wait)
        counts = write_ring(sampled.slot(step.plan.ring_slot), out)
        if out.pooled is not None:  # (embeddings' vectors travel in the report: pooling.py)
            step.pooled = vector_bytes(out.pooled)
        on_done(step, *counts, start, end)


def hold_host(ms: float) -> None:
    """Python work for `ms` milliseconds on this thread, holding the GIL as a launch loop does
    (other threads get it only at the interpreter's switch interval)."""
    deadline = now_ns() + int(ms * 1e6)
    while now_ns() < deadline:
        sum(range(64))


class TimedDevice:
    """The timed instrument as a fast GPU's host sees it. `submit` runs on the host loop's
    (main) thread: the step's slot updates and tokens (the instrument's compute, host tensors),
    then S ms of Python work that holds the GIL the way a real launch does (slot updates,
    sampling, output packing and view calls outside a CUDA graph: ~0.8 ms on the H200's
    host). The step then occupies the device from max(the previous step's end, its launch)
    for A + B * tokens ms, so the host's lateness shows as idle; a notifier thread waits for
    each step's end, copies its ids into the sampled ring and reports it, as CUDA's does."""

    def __init__(self, runner: TimedRunner, sampled: SharedRing, on_done: OnDone) -> None:
        self.runner, self.sampled, self.on_done = runner, sampled, on_done
        self.error: BaseException | None = None
        # As on CUDA: the notifier needs the GIL for a moment while the host launches.
        sys.setswitchinterval(min(sys.getswitchinterval(), CudaDevice.SWITCH_INTERVAL_S))
        self._free_at = 0  # when the device's last queued step ends (ns)
        self._pending: queue.SimpleQueue[Done | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._notify, name="timed-notify", daemon=True)
        self._thread.start()

    def serve(self, host_loop: HostLoop, stop: threading.Event) -> None:
        """The host loop launches the steps itself, on this (main) thread."""
        host_loop()

    def submit(self, step: HostStep) -> None:
        out = self.runner.compute(step, step.packed)
        if self.runner.s_ms:
            hold_host(self.runner.s_ms)
        pp = self.runner.pp
        ready = now_ns()  # (launched now)
        if pp is not None:  # ... and its input exists
            ready = max(ready, self._input_at(step, pp))
        start = max(self._free_at, ready)
        self._free_at = start + int(self.runner.step_ms(step) * 1e6)
        if pp is not None:
            self._pass_on(step, out, pp)
        self._pending.put((step, out, start, self._free_at))

    def _input_at(self, step: HostStep, pp: PipelineParallel) -> int:
        """A pipeline stage's step starts once the previous stage's part of it ended, and
        the first stage's once the samples its placeholders take exist (the times travel as
        the hidden states and samples would: parallel.py)."""
        if not pp.first:
            return pp.recv_time()
        slots = step.placeholder_slots
        return pp.settle(slots, self.runner.slots.last_sampled) if slots else 0

    def _pass_on(self, step: HostStep, out: SampleOutput, pp: PipelineParallel) -> None:
        if pp.first:  # (before the step is on its way: see ModelRunner._compute_stage)
            pp.expect_samples(step.plan.step_id, torch.from_numpy(step.sample_slots),
                              step.sample_slots.tolist(), self.runner.slots.last_sampled,
                              timed=True)
        if not pp.last:
            pp.send_time(self._free_at)
        else:
            pp.send_samples(out.tokens, self._free_at)

    def _notify(self) -> None:
        try:
            report_steps(self._pending, self.sampled, self.on_done, at_end=True)
        except BaseException as exc:
            logger.exception("timed notifier failed")
            self.error = exc

    def close(self) -> None:
        self._pending.put(None)
        self._thread.join(timeout=30)


def register_host_memory(ring: SharedRing) -> None:
    """Page-lock a shared ring so copies to and from it are truly asynchronous."""
    buf = ctypes.c_char.from_buffer(ring.buffer)
    err = torch.cuda.cudart().cudaHostRegister(ctypes.addressof(buf), len(ring.buffer), 0)
    if int(err) != 0:
        raise RuntimeError(f"cudaHostRegister of {ring.name} failed with error {int(err)}")


def unregister_host_memory(ring: SharedRing) -> None:
    buf = ctypes.c_char.from_buffer(ring.buffer)
    err = torch.cuda.cudart().cudaHostUnregister(ctypes.addressof(buf))
    del buf  # (the mapping cannot close while a ctypes view of it lives)
    if int(err) != 0:
        logger.warning("cudaHostUnregister of %s failed with error %d", ring.name, int(err))


class EventPool:
    """CUDA events for reuse: a step takes three to four, and making each costs host time
    in the launch loop. take() one; give() it back once nothing will read it again (the
    notifier does, after the step completed). deque's append and pop are thread-safe."""

    def __init__(self, make: Callable[[], Any]) -> None:
        self._make, self._free = make, deque[Any]()

    def take(self) -> Any:
        try:
            return self._free.pop()
        except IndexError:
            return self._make()

    def give(self, *events: Any) -> None:
        self._free.extend(events)


class StepClock:
    """Device intervals of consecutive steps on the host's clock, from the steps' own events:
    busy is elapsed(start, end) of the step, and its start sits elapsed(previous end, start)
    after the previous step's end. Each elapsed time is short, so it keeps its precision (one
    base event for every step would lose it after hours: the elapsed time is float ms).
    After a gap of more than REANCHOR_MS (the device had no work), or when the chain has
    drifted from the host's clock (a step cannot end after the host saw it end, nor long
    before), it is anchored again at the time the host saw the step complete."""

    REANCHOR_MS = 1000.0

    def __init__(self, base_event: Any, base_ns: int) -> None:
        self._last = (base_event, base_ns)

    def place(self, start: Any, end: Any, observed_ns: int) -> tuple[int, int, Any]:
        """(start ns, end ns) of a completed step whose events are start and end, and the
        previous step's end event, which nothing reads any more."""
        last_event, last_ns = self._last
        gap_ms, busy_ns = last_event.elapsed_time(start), int(start.elapsed_time(end) * 1e6)
        t0 = last_ns + int(gap_ms * 1e6)
        t1 = t0 + busy_ns
        if gap_ms > self.REANCHOR_MS or not 0 <= observed_ns - t1 <= self.REANCHOR_MS * 1e6:
            t1 = observed_ns
            t0 = t1 - busy_ns
        self._last = (end, t1)
        return t0, t1, last_event


class CudaDevice:
    # The notifier needs the GIL for a moment after each step; the host loop's launches hold
    # it. Python's default switch interval (5 ms) would let a report wait that long; at 0.5 ms
    # the report of a step took 0.6-0.9 ms (p50) on the timed instrument with a 0.8 ms launch,
    # at 0.1 ms 0.37-0.6 (batch 64, 2-core host), the most of the chain after the launch.
    SWITCH_INTERVAL_S = 0.0001

    def __init__(self, runner: Runner, sampled: SharedRing, on_done: OnDone) -> None:
        self.runner, self.sampled, self.on_done = runner, sampled, on_done
        self.error: BaseException | None = None
        register_host_memory(sampled)
        sys.setswitchinterval(min(sys.getswitchinterval(), self.SWITCH_INTERVAL_S))
        # Per ring slot, page-locked bytes for each packed group of a step's result.
        # (Keyed by each group's first field: the sampled positions, the rows with drafts,
        # the scored prompt positions.)
        specs = {spec.name: spec for spec in sampled.specs}

        def row_bytes(kind: str) -> int:
            return sum(np.dtype(spec.dtype).itemsize * int(np.prod(spec.shape[1:], dtype=np.int64))
                       for name, spec in specs.items() if _group_of(name) == kind)

        self._bounce = [{kind: torch.empty(specs[kind].shape[0] * row_bytes(kind),
                                           dtype=torch.uint8, pin_memory=True)
                         for kind in ("token_ids", "num_accepted", "plp_logprob")}
                        for _ in range(sampled.num_slots)]
        self.copy_stream, self.compute_stream, self.d2h_stream = (
            torch.cuda.Stream(), torch.cuda.Stream(), torch.cuda.Stream())
        for stream in (self.copy_stream, self.compute_stream, self.d2h_stream):
            stream.wait_stream(torch.cuda.current_stream())  # weights and cache are ready
        self._plain = EventPool(torch.cuda.Event)
        self._timed = EventPool(lambda: torch.cuda.Event(enable_timing=True))
        # The notifier sleeps on these, it does not spin.
        self._blocking = EventPool(lambda: torch.cuda.Event(blocking=True))
        base = torch.cuda.Event(enable_timing=True)
        base.record()
        base.synchronize()  # once, at start: maps device time onto the host clock
        self._clock = StepClock(base, now_ns())
        self._pending: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._notify, name="cuda-notify", daemon=True)
        self._thread.start()

    def serve(self, host_loop: HostLoop, stop: threading.Event) -> None:
        """The host loop launches the kernels itself, on this (main) thread."""
        host_loop()

    def submit(self, step: HostStep) -> None:
        """Enqueue copy -> compute -> copy back; returns at once (no host synchronisation)."""
        device = self.runner.device
        copied, start, end, done = (self._plain.take(), self._timed.take(), self._timed.take(),
                                    self._blocking.take())
        with torch.cuda.stream(self.copy_stream):
            packed = step.packed.to(device, non_blocking=True)  # from pinned staging
            copied.record()
        self.compute_stream.wait_event(copied)
        with torch.cuda.stream(self.compute_stream):
            packed.record_stream(self.compute_stream)
            start.record()
            out = self.runner.compute(step, packed)
            groups = pack_outputs(out)
            end.record()
        self.d2h_stream.wait_event(end)
        with torch.cuda.stream(self.d2h_stream):
            copies = []
            for data, fields in groups:
                data.record_stream(self.d2h_stream)
                bounce = self._bounce[step.plan.ring_slot][fields[0][0]]
                host = bounce[:data.numel()].view(data.shape)
                host.copy_(data, non_blocking=True)
                copies.append((host, fields))
            pooled = None
            if out.pooled is not None:  # (embeddings' vectors: one page-locked copy)
                out.pooled.record_stream(self.d2h_stream)
                pooled = torch.empty(out.pooled.shape, dtype=torch.float32, pin_memory=True)
                pooled.copy_(out.pooled, non_blocking=True)
            done.record()
        self._pending.put((step, _counts(out), copies, pooled, (copied, start, end, done)))

    def _notify(self) -> None:
        try:
            while (item := self._pending.get()) is not None:
                step, counts, copies, pooled, (copied, start, end, done) = item
                done.synchronize()  # this thread waits; the host loop and the device do not
                if pooled is not None:
                    step.pooled = vector_bytes(pooled)
                t0, t1, previous_end = self._clock.place(start, end, now_ns())
                ring = self.sampled.slot(step.plan.ring_slot)
                for host, fields in copies:
                    unpack_outputs(host.numpy(), fields, ring)
                self._plain.give(copied)
                self._timed.give(start, previous_end)
                self._blocking.give(done)
                self.on_done(step, *counts, t0, t1)
        except BaseException as exc:
            logger.exception("CUDA notifier failed")
            self.error = exc

    def close(self) -> None:
        """Stop the notifier, wait for the device, and unpin the ring (its mapping outlives
        this device in the process)."""
        self._pending.put(None)
        self._thread.join(timeout=30)
        torch.cuda.synchronize()
        unregister_host_memory(self.sampled)
