"""Where steps run, in the executor process. The host loop prepares step N+1 while the device
runs step N; each device reports a finished step with its busy interval. Each device owns its
threads: `serve(host_loop, stop)` runs the host loop where that device wants it, and
`make_device` is the one place that picks the device for a runner.

CpuDevice: the CPU (or the timed instrument): the main thread executes queued steps in order
while a host thread runs the host loop (PyTorch releases the GIL inside kernels); completion
flags are the queue itself.
CudaDevice: the host loop runs on the main thread and launches each step on copy, compute and
device->host streams ordered by CUDA events; the staging buffers and the sampled-token ring are
page-locked; a notifier thread waits on each step's last event, never the host loop.
"""

from __future__ import annotations

import ctypes
import logging
import queue
import threading
from collections.abc import Callable
from typing import Any, Protocol

import torch

from ipc.shm import SharedRing
from stages.executor.runner import Runner
from stages.executor.sampler import SampleOutput
from stages.executor.step_inputs import HostStep
from stages.trace import now_ns

logger = logging.getLogger(__name__)

# (step, num_sampled, has_logprobs, num_prompt_logprobs, device_start_ns, device_end_ns); the
# ids (and logprobs) are already in the step's sampled-token ring slot.
OnDone = Callable[[HostStep, int, bool, int, int, int], None]


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
    return CpuDevice(runner, sampled, on_done)


def _with_logprobs(out: SampleOutput) -> list[tuple[str, torch.Tensor]]:
    """The (ring field, tensor) pairs a step's result fills in the sampled-token ring."""
    pairs = [("token_ids", out.tokens)]
    if out.logprob is not None and out.top_ids is not None and out.top_logprobs is not None:
        pairs += [("logprob", out.logprob), ("top_ids", out.top_ids),
                  ("top_logprobs", out.top_logprobs)]
    if out.prompt is not None:
        pairs += [("plp_logprob", out.prompt.logprob), ("plp_rank", out.prompt.rank),
                  ("plp_top_ids", out.prompt.top_ids),
                  ("plp_top_logprobs", out.prompt.top_logprobs)]
    return pairs


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
        self._done: queue.SimpleQueue[tuple[HostStep, SampleOutput, int, int] | None] = (
            queue.SimpleQueue())
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
            self.run(stop)
        except BaseException:
            stop.set()
            raise
        finally:
            thread.join(timeout=5)
        if failure:
            raise RuntimeError("the executor's host loop failed") from failure[0]

    def run(self, stop: threading.Event) -> None:
        """Execute submitted steps until stop is set or close() is called."""
        try:
            while not stop.is_set():
                try:
                    step = self._queue.get(timeout=0.1)
                except queue.Empty:
                    continue
                if step is None:
                    return
                start = now_ns()
                out = self.runner.compute(step, step.packed)
                self._done.put((step, out, start, now_ns()))
        finally:
            self._done.put(None)

    def _report(self) -> None:
        try:
            while (item := self._done.get()) is not None:
                step, out, start, end = item
                ring = self.sampled.slot(step.plan.ring_slot)
                for name, tensor in _with_logprobs(out):
                    ring[name][: len(tensor)] = tensor.numpy()
                self.on_done(step, *_counts(out), start, end)
        except BaseException as exc:
            logger.exception("report thread failed")
            self.error = exc

    def close(self) -> None:
        self._queue.put(None)
        self._done.put(None)
        self._reporter.join(timeout=30)


def register_host_memory(ring: SharedRing) -> None:
    """Page-lock a shared ring so copies to and from it are truly asynchronous."""
    buf = ctypes.c_char.from_buffer(ring.buffer)
    err = torch.cuda.cudart().cudaHostRegister(ctypes.addressof(buf), len(ring.buffer), 0)
    if int(err) != 0:
        raise RuntimeError(f"cudaHostRegister of {ring.name} failed with error {int(err)}")


class CudaDevice:
    def __init__(self, runner: Runner, sampled: SharedRing, on_done: OnDone) -> None:
        self.runner, self.sampled, self.on_done = runner, sampled, on_done
        self.error: BaseException | None = None
        register_host_memory(sampled)
        self._host_out = [{name: torch.from_numpy(array)
                           for name, array in sampled.slot(i).items()}
                          for i in range(sampled.num_slots)]
        self.copy_stream, self.compute_stream, self.d2h_stream = (
            torch.cuda.Stream(), torch.cuda.Stream(), torch.cuda.Stream())
        for stream in (self.copy_stream, self.compute_stream, self.d2h_stream):
            stream.wait_stream(torch.cuda.current_stream())  # weights and cache are ready
        self._base = torch.cuda.Event(enable_timing=True)
        self._base.record()
        self._base.synchronize()  # once, at start: maps device time onto the host clock
        self._base_ns = now_ns()
        self._pending: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._notify, name="cuda-notify", daemon=True)
        self._thread.start()

    def serve(self, host_loop: HostLoop, stop: threading.Event) -> None:
        """The host loop launches the kernels itself, on this (main) thread."""
        host_loop()

    def submit(self, step: HostStep) -> None:
        """Enqueue copy -> compute -> copy back; returns at once (no host synchronisation)."""
        device = self.runner.device
        with torch.cuda.stream(self.copy_stream):
            packed = step.packed.to(device, non_blocking=True)  # from pinned staging
            copied = torch.cuda.Event()
            copied.record()
        self.compute_stream.wait_event(copied)
        with torch.cuda.stream(self.compute_stream):
            packed.record_stream(self.compute_stream)
            start = torch.cuda.Event(enable_timing=True)
            start.record()
            out = self.runner.compute(step, packed)
            end = torch.cuda.Event(enable_timing=True)
            end.record()
        self.d2h_stream.wait_event(end)
        pairs = _with_logprobs(out)
        with torch.cuda.stream(self.d2h_stream):
            host = self._host_out[step.plan.ring_slot]
            for name, tensor in pairs:
                tensor.record_stream(self.d2h_stream)
                host[name][: tensor.shape[0]].copy_(tensor, non_blocking=True)
            done = torch.cuda.Event(blocking=True)  # the notifier sleeps on it, not spins
            done.record()
        self._pending.put((step, _counts(out), start, end, done))

    def _notify(self) -> None:
        try:
            while (item := self._pending.get()) is not None:
                step, counts, start, end, done = item
                done.synchronize()  # this thread waits; the host loop and the device do not
                t0 = self._base_ns + int(self._base.elapsed_time(start) * 1e6)
                t1 = self._base_ns + int(self._base.elapsed_time(end) * 1e6)
                self.on_done(step, *counts, t0, t1)
        except BaseException as exc:
            logger.exception("CUDA notifier failed")
            self.error = exc

    def close(self) -> None:
        self._pending.put(None)
        self._thread.join(timeout=30)
