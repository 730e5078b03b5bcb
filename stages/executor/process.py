"""Process entry of the executor: the host loop receives step plans and prepares each one while
the device runs the previous; the device reports each finished step with the tiny
sampled-token message (the ids themselves are in the shared sampled-token ring)."""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING

import torch
import zmq

from ipc.channels import PullChannel, PushChannel
from ipc.codec import Codec
from ipc.messages import SampledTokens, StepPlan
from ipc.rings import MAX_TOP_LOGPROBS, sampled_specs, step_input_specs
from ipc.shm import SharedRing
from stages.executor.device import CudaDevice, ThreadDevice
from stages.executor.runner import ModelRunner, RunnerShape, TimedRunner
from stages.executor.step_inputs import HostStep
from stages.process import StageContext, stage_process
from stages.trace import now_ns

if TYPE_CHECKING:
    from pipeline.config import PipelineConfig

logger = logging.getLogger(__name__)


def build_runner(cfg: PipelineConfig) -> ModelRunner | TimedRunner:
    ex, s = cfg.executor, cfg.scheduler
    shape = RunnerShape(s.max_num_seqs, s.block_size, cfg.model.max_model_len,
                        ex.kv_cache_memory, s.max_num_batched_tokens, cfg.max_block_updates,
                        s.num_ring_slots, len(cfg.model.eos_token_ids))
    if ex.timed is not None:
        return TimedRunner(ex.timed[0], ex.timed[1], shape, cfg.model.vocab_size)
    if ex.num_threads:
        torch.set_num_threads(ex.num_threads)
    device = torch.device(ex.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)  # streams and events are made on the current device
    return ModelRunner.from_dir(cfg.model.path, getattr(torch, ex.dtype), device, shape)


def attach_rings(cfg: PipelineConfig) -> tuple[SharedRing, SharedRing]:
    s = cfg.scheduler
    steps = SharedRing(cfg.step_ring_name, step_input_specs(
        s.max_num_seqs, s.max_num_batched_tokens, cfg.max_block_updates),
        s.num_ring_slots, create=False)
    sampled = SharedRing(cfg.sampled_ring_name, sampled_specs(s.max_num_seqs),
                         s.num_ring_slots, create=False)
    return steps, sampled


class Reporter:
    """Sends SampledTokens from the device's thread; its socket is used by that thread only."""

    def __init__(self, ctx: StageContext, address: str) -> None:
        self.ctx, self.address = ctx, address
        self._chan: PushChannel | None = None

    def __call__(self, step: HostStep, num_sampled: int, has_logprobs: bool, start_ns: int,
                 end_ns: int) -> None:
        if self._chan is None:
            self._chan = PushChannel(self.ctx.zmq, self.address, bind=False)
        plan = step.plan
        self._chan.send(SampledTokens(plan.step_id, plan.ring_slot, num_sampled,
                                      start_ns / 1e9, end_ns / 1e9,
                                      MAX_TOP_LOGPROBS if has_logprobs else -1))
        self.ctx.tracer.span("device", start_ns, end_ns, "device",
                             {"step": plan.step_id, "tokens": plan.num_tokens,
                              "seqs": plan.num_seqs})


def run_executor(cfg: PipelineConfig, rank: int, parent_pid: int) -> None:
    with stage_process("executor", rank, cfg, parent_pid) as ctx:
        runner = build_runner(cfg)
        steps, sampled = attach_rings(cfg)
        plans = PullChannel(ctx.zmq, cfg.executor_address, Codec([StepPlan]), bind=True)
        report = Reporter(ctx, cfg.sampled_address)
        is_cuda = isinstance(runner, ModelRunner) and runner.device.type == "cuda"
        device = (CudaDevice if is_cuda else ThreadDevice)(runner, sampled, report)
        ctx.ready(num_kv_blocks=runner.num_blocks)
        try:
            if isinstance(device, ThreadDevice):
                run_cpu_device(ctx, plans, runner, steps, device)
            else:
                host_loop(ctx, plans, runner, steps, device)
        finally:
            device.close()


def run_cpu_device(ctx: StageContext, plans: PullChannel, runner: ModelRunner | TimedRunner,
                   steps: SharedRing, device: ThreadDevice) -> None:
    """The device computes on this (main) thread; the host loop runs beside it."""
    failure: list[BaseException] = []

    def host() -> None:
        try:
            host_loop(ctx, plans, runner, steps, device)
        except BaseException as exc:
            failure.append(exc)
            ctx.stop.set()

    thread = threading.Thread(target=host, name="host", daemon=True)
    thread.start()
    try:
        device.run(ctx.stop)
    except BaseException:
        ctx.stop.set()
        raise
    finally:
        thread.join(timeout=5)
    if failure:
        raise RuntimeError("the executor's host loop failed") from failure[0]


def host_loop(ctx: StageContext, plans: PullChannel, runner: ModelRunner | TimedRunner,
              steps: SharedRing, device: CudaDevice | ThreadDevice) -> None:
    while not ctx.stop.is_set():
        if device.error is not None:
            raise RuntimeError("the device failed") from device.error
        try:
            plan = plans.recv(timeout_ms=100)  # a malformed plan is a bug: the stage fails
        except zmq.ContextTerminated:
            return
        if plan is None:
            continue
        assert isinstance(plan, StepPlan)
        start = now_ns()
        step = runner.prepare(plan, steps.slot(plan.ring_slot))
        device.submit(step)
        ctx.tracer.span("prepare", start, now_ns(), "host", {"step": plan.step_id})
