"""Process entry of the executor: the host loop receives step plans and prepares each one while
the device runs the previous; the device reports each finished step with the tiny
sampled-token message (the ids themselves are in the shared sampled-token ring)."""

from __future__ import annotations

import logging

import torch
import zmq

from ipc.channels import PullChannel, PushChannel
from ipc.codec import Codec
from ipc.config import PipelineConfig
from ipc.messages import SampledTokens, StepPlan
from ipc.params import MAX_TOP_LOGPROBS
from ipc.shm import SharedRing
from ipc.step import StepRings
from stages.executor.compile import resolve_compile
from stages.executor.device import Device, make_device
from stages.executor.runner import ModelRunner, Runner, TimedRunner
from stages.executor.step_inputs import HostStep
from stages.process import StageContext, stage_process
from stages.trace import now_ns

logger = logging.getLogger(__name__)


def build_runner(cfg: PipelineConfig) -> Runner:
    ex, limits = cfg.executor, cfg.limits
    if ex.timed is not None:
        return TimedRunner(ex.timed[0], ex.timed[1], limits)
    if ex.num_threads:
        torch.set_num_threads(ex.num_threads)
    device = torch.device(ex.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)  # streams and events are made on the current device
    return ModelRunner.from_dir(cfg.model.path, getattr(torch, ex.dtype), device, limits,
                                ex.kv_cache_memory,
                                resolve_compile(ex.compile, device, cfg.model.sliding_window,
                                                limits.block_size),
                                graphs=ex.cuda_graphs and device.type == "cuda")


class Reporter:
    """Sends SampledTokens from the device's thread; its socket is used by that thread only."""

    def __init__(self, ctx: StageContext, address: str, secret: bytes) -> None:
        self.ctx, self.address, self.secret = ctx, address, secret
        self._chan: PushChannel | None = None

    def __call__(self, step: HostStep, num_sampled: int, has_logprobs: bool,
                 num_prompt_logprobs: int, start_ns: int, end_ns: int) -> None:
        if self._chan is None:
            self._chan = PushChannel(self.ctx.zmq, self.address, bind=False, secret=self.secret)
        plan = step.plan
        self._chan.send(SampledTokens(plan.step_id, plan.ring_slot, num_sampled,
                                      start_ns / 1e9, end_ns / 1e9,
                                      MAX_TOP_LOGPROBS if has_logprobs else -1,
                                      num_prompt_logprobs))
        self.ctx.tracer.span("device", start_ns, end_ns, "device",
                             {"step": plan.step_id, "tokens": plan.num_tokens,
                              "seqs": plan.num_seqs})


def run_executor(cfg: PipelineConfig, rank: int, parent_pid: int) -> None:
    with stage_process("executor", rank, cfg, parent_pid) as ctx:
        runner = build_runner(cfg)
        rings = StepRings.open(cfg, create=True)
        plans = PullChannel(ctx.zmq, cfg.executor_address, Codec([StepPlan]), bind=True,
                            secret=cfg.run_secret)
        device = make_device(runner, rings.sampled, Reporter(ctx, cfg.sampled_address,
                                                             cfg.run_secret))
        ctx.ready(num_kv_blocks=runner.num_blocks)
        if runner.slots.matchers is not None:
            runner.slots.matchers.grammars.warm()
        try:
            device.serve(lambda: host_loop(ctx, plans, runner, rings.steps, device), ctx.stop)
        finally:
            device.close()


def host_loop(ctx: StageContext, plans: PullChannel, runner: Runner, steps: SharedRing,
              device: Device) -> None:
    while not ctx.stop.is_set():
        if device.error is not None:
            raise RuntimeError("the device failed") from device.error
        try:  # a foreign frame is refused; a malformed plan of this run is a bug: it raises
            plan = plans.recv_foreign_safe(timeout_ms=100)
        except zmq.ContextTerminated:
            return
        if plan is None:
            continue
        assert isinstance(plan, StepPlan)
        start = now_ns()
        step = runner.prepare(plan, steps.slot(plan.ring_slot))
        prepared = now_ns()
        device.submit(step)  # on CUDA: launching the step's kernels
        ctx.tracer.span("prepare", start, prepared, "host", {"step": plan.step_id})
        ctx.tracer.span("submit", prepared, now_ns(), "host", {"step": plan.step_id})
