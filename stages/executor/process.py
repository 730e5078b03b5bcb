"""Process entry of the executor: receives step plans, runs them, answers with the tiny
sampled-token message; the ids themselves go through the shared sampled-token ring."""

from __future__ import annotations

import logging
import os
import time
from typing import TYPE_CHECKING

import torch

from ipc.channels import PullChannel, PushChannel
from ipc.codec import Codec
from ipc.messages import SampledTokens, StepPlan
from ipc.rings import sampled_specs, step_input_specs
from ipc.shm import SharedRing
from stages.executor.runner import ModelRunner, RunnerShape
from stages.process import stage_process

if TYPE_CHECKING:
    from pipeline.config import PipelineConfig

logger = logging.getLogger(__name__)


def build_runner(cfg: PipelineConfig) -> ModelRunner:
    ex = cfg.executor
    if ex.num_threads:
        torch.set_num_threads(ex.num_threads)
    device = torch.device(ex.device)
    shape = RunnerShape(cfg.scheduler.max_num_seqs, cfg.scheduler.block_size,
                        cfg.model.max_model_len, ex.kv_cache_memory)
    return ModelRunner.from_dir(cfg.model.path, getattr(torch, ex.dtype), device, shape)


def attach_rings(cfg: PipelineConfig) -> tuple[SharedRing, SharedRing]:
    s = cfg.scheduler
    steps = SharedRing(cfg.step_ring_name, step_input_specs(
        s.max_num_seqs, s.max_num_batched_tokens, cfg.max_block_updates),
        s.num_ring_slots, create=False)
    sampled = SharedRing(cfg.sampled_ring_name, sampled_specs(s.max_num_seqs),
                         s.num_ring_slots, create=False)
    return steps, sampled


def run_executor(cfg: PipelineConfig, rank: int, parent_pid: int) -> None:
    with stage_process("executor", rank, cfg.control_address, parent_pid) as ctx:
        runner = build_runner(cfg)
        steps, sampled = attach_rings(cfg)
        plans = PullChannel(ctx.zmq, cfg.executor_address, Codec([StepPlan]), bind=True)
        out = PushChannel(ctx.zmq, cfg.sampled_address, bind=False)
        ctx.ready(num_kv_blocks=runner.num_blocks)
        while not ctx.stop.is_set():
            plan = plans.recv(timeout_ms=100)  # a malformed plan is a bug: the stage fails
            if plan is None:
                continue
            assert isinstance(plan, StepPlan)
            start = time.perf_counter()
            tokens = runner.execute(plan, steps.slot(plan.ring_slot))
            slot = plan.step_id % sampled.num_slots
            sampled.slot(slot)["token_ids"][: len(tokens)] = tokens.cpu().numpy()
            end = time.perf_counter()
            out.send(SampledTokens(plan.step_id, slot, len(tokens), start, end))
        logger.info("executor %d stopping", os.getpid())
