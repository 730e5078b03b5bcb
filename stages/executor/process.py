"""Process entry of the executor: the host loop receives step plans and prepares each one while
the device runs the previous; the device reports each finished step with the tiny
sampled-token message (the ids themselves are in the shared sampled-token ring)."""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import zmq

from ipc.channels import PullChannel, PushChannel
from ipc.codec import Codec
from ipc.config import PipelineConfig
from ipc.families import read_config
from ipc.messages import LastStep, RemoteSampled, RemoteStep, SampledTokens, StepPlan
from ipc.params import MAX_TOP_LOGPROBS
from ipc.ranks import partition_layers
from ipc.shm import BufferSpec, SharedRing
from ipc.step import StepRings, sampled_specs, step_input_specs
from stages.executor.device import Device, OnDone, make_device
from stages.executor.joined_stages import (
    SAMPLES_KEY,
    JoinedFollower,
    SamplesRelay,
    bind_inbox,
    joined_samples,
    lookup,
    plans_codec,
    plans_key,
    unpack_plan,
)
from stages.executor.parallel import engine_store, join_engine, leave_engine
from stages.executor.runner import ModelRunner, Runner, TimedRunner
from stages.executor.step_inputs import HostStep
from stages.process import StageContext, stage_process
from stages.trace import now_ns

logger = logging.getLogger(__name__)

# A tensor-parallel rank beyond the first that is told to stop keeps running the first rank's
# plans until it announces its last one (LastStep), at most this long (it may be gone).
DRAIN_TIMEOUT_S = 5.0


def meeting_place(cfg: PipelineConfig, rank: int, rendezvous: str) -> dist.Store | None:
    """The store where the engine's ranks meet (None: one rank): the run directory's file,
    or with joined pipeline stages the TCP store at `rendezvous`, the engine's first rank's
    (the launcher names it anew each time the engine starts)."""
    layout = cfg.ranks
    if layout.ranks_per_engine == 1:
        return None
    return engine_store(rank, layout.ranks_per_engine,
                        str(Path(cfg.run_dir) / f"tp-store-{cfg.engine}"), rendezvous)


def build_runner(cfg: PipelineConfig, rank: int = 0, store: dist.Store | None = None) -> Runner:
    """The runner of rank `rank` of engine cfg.engine (its place in the engine's stages of
    tensor ranks: ipc/ranks.py), meeting the other ranks in `store` (meeting_place)."""
    ex, limits = cfg.executor, cfg.limits
    layout = cfg.ranks
    host = cfg.remote.listen_host if layout.joined_stages else ""  # (across hosts: gloo's)
    if ex.timed is not None:  # (pipeline stages of instruments pass each step on: device.py)
        pp = None
        if ex.pipeline_parallel_size > 1:
            assert store is not None
            stages = [range(s, s + 1) for s in range(ex.pipeline_parallel_size)]
            _, pp = join_engine(rank, 1, stages, store, torch.device("cpu"), limits.vocab_size)
        return TimedRunner(ex.timed[0], ex.timed[1], limits, ex.timed[2], pp)
    device = torch.device(ex.device)
    joined = layout.joined(layout.head(cfg.engine) + rank)  # (on a pipeline host)
    num_procs = len(layout.joined_ranks(cfg.engine)) if joined else layout.num_local_ranks
    if ex.num_threads:
        torch.set_num_threads(ex.num_threads)
    elif num_procs > 1 and device.type == "cpu":  # the executors here share the cores
        torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // num_procs))
    if device.type == "cuda" and layout.num_ranks > 1:  # a GPU per process here
        # (parallel.check_devices; an engine that joined from another host has that host's
        # GPUs from 0, as a pipeline host has for its ranks: RankLayout.device_index)
        index = (rank if cfg.remote.launcher_status and not joined
                 else layout.device_index(layout.head(cfg.engine) + rank))
        device = torch.device("cuda", index)
    if device.type == "cuda":
        torch.cuda.set_device(device)  # streams and events are made on the current device
    tp = pp = None
    if layout.ranks_per_engine > 1:
        assert store is not None
        layers = partition_layers(read_config(cfg.model.path)[1].num_layers,
                                  ex.pipeline_parallel_size, ex.pipeline_layer_partition)
        tp, pp = join_engine(rank, ex.tensor_parallel_size, layers, store, device,
                             limits.vocab_size, host)
    runner = ModelRunner.from_dir(cfg.model.path, getattr(torch, ex.dtype), device, limits,
                                  ex.kv_cache_memory, ex.compile,
                                  graphs=ex.cuda_graphs and device.type == "cuda", tp=tp, pp=pp,
                                  quantization=ex.quantization,
                                  speculative=cfg.scheduler.speculative,
                                  kv_cache_dtype=ex.kv_cache_dtype, lora=cfg.lora)
    runner.warm_up()  # (before the stage says it is ready: the first requests find it warm)
    return runner


class Reporter:
    """Sends SampledTokens from the device's thread; its socket is used by that thread only.
    joined: this rank's own sampled-token ring, on a host that joined (ipc/ranks.py): the
    report goes with the ring slot's entries to the engine's first rank (RemoteSampled)."""

    def __init__(self, ctx: StageContext, address: str, secret: bytes,
                 joined: SharedRing | None = None) -> None:
        self.ctx, self.address, self.secret, self.joined = ctx, address, secret, joined
        self._chan: PushChannel | None = None

    def __call__(self, step: HostStep, num_sampled: int, has_logprobs: bool,
                 num_prompt_logprobs: int, start_ns: int, end_ns: int) -> None:
        if self._chan is None:
            self._chan = PushChannel(self.ctx.zmq, self.address, bind=False, secret=self.secret)
        plan = step.plan
        tokens = SampledTokens(plan.step_id, plan.ring_slot, num_sampled, start_ns / 1e9,
                               end_ns / 1e9, MAX_TOP_LOGPROBS if has_logprobs else -1,
                               num_prompt_logprobs, step.pooled)
        self._chan.send(tokens if self.joined is None
                        else joined_samples(tokens, self.joined, plan.num_seqs))
        self.ctx.tracer.span("device", start_ns, end_ns, "device",
                             {"step": plan.step_id, "tokens": plan.num_tokens,
                              "seqs": plan.num_seqs})


def run_executor(cfg: PipelineConfig, rank: int, parent_pid: int, rendezvous: str = "") -> None:
    """Executor `rank` is rank `rank % R` of engine `rank // R` (R: its ranks, P stages of K
    tensor ranks; ipc/ranks.py). Rank 0 of an engine receives its scheduler's plans (and
    forwards each to the engine's other ranks, if any); the last stage's first rank (rank 0
    itself with one stage) reports samples; the others follow rank 0. rendezvous: HOST:PORT
    of the engine's TCP store, where some of its stages run on another host (joined_stages)."""
    layout = cfg.ranks
    stage_rank, cfg = rank, cfg.for_engine(layout.engine_of(rank))
    rank = layout.local_rank(stage_rank)
    reporter = layout.local_rank(layout.reporter(cfg.engine))
    detail = layout.describe(stage_rank) if layout.ranks_per_engine > 1 else ""
    with stage_process("executor", stage_rank, cfg, parent_pid, detail) as ctx:
        store = meeting_place(cfg, rank, rendezvous)  # (rank 0 serves a TCP store: first)
        if rank > 0:
            _follow(ctx, cfg, rank, store, reports=rank == reporter)
            return
        rings = StepRings.open(cfg, create=True)  # before the ranks meet: they map it then
        inbox = None
        if layout.joined_stages:  # (its address in the store before the ranks meet)
            inbox, address = bind_inbox(ctx.zmq, cfg, Codec([RemoteSampled]))
            assert store is not None
            store.set(SAMPLES_KEY, address)
        runner = build_runner(cfg, 0, store)
        plans = PullChannel(ctx.zmq, cfg.executor_address, Codec([StepPlan]), bind=True,
                            secret=cfg.keys.run_secret)
        followers: list[PushChannel | JoinedFollower] = []
        for r in range(1, layout.ranks_per_engine):
            if layout.joined(layout.head(cfg.engine) + r):
                assert store is not None
                followers.append(JoinedFollower(ctx.zmq, cfg, lookup(store, plans_key(r)),
                                                rings.steps))
            else:
                followers.append(PushChannel(ctx.zmq, tp_plan_address(cfg, r), bind=False,
                                             secret=cfg.keys.run_secret))
        # (with pipeline stages this rank samples nothing: the last stage reports)
        report: OnDone = (Reporter(ctx, cfg.sampled_address, cfg.keys.run_secret)
                          if reporter == 0 else StageSpans(ctx, 0))
        device = make_device(runner, rings.sampled, report)
        relay = SamplesRelay(ctx.zmq, cfg, inbox, rings.sampled) if inbox is not None else None
        ctx.ready(num_kv_blocks=runner.num_blocks)
        if runner.slots.matchers is not None:
            runner.slots.matchers.grammars.warm()
        try:
            device.serve(lambda: host_loop(ctx, plans, runner, rings.steps, device, followers,
                                           relay=relay), ctx.stop)
        finally:
            device.close()
            if relay is not None:
                relay.close()
            _leave(runner)


class StageSpans:
    """A pipeline stage's finished steps as trace spans ("stage-device", its stage and the
    step: bench overlap's idle per stage), on its first tensor rank; the last stage reports
    too."""

    def __init__(self, ctx: StageContext, stage: int) -> None:
        self.ctx, self.stage = ctx, stage

    def __call__(self, step: HostStep, num_sampled: int, has_logprobs: bool,
                 num_prompt_logprobs: int, start_ns: int, end_ns: int) -> None:
        self.ctx.tracer.span("stage-device", start_ns, end_ns, "device",
                             {"step": step.plan.step_id, "stage": self.stage})


def tp_plan_address(cfg: PipelineConfig, rank: int) -> str:
    """Where the engine's rank `rank` (> 0) receives the plans rank 0 forwards."""
    return cfg.engine_address(f"executor-tp-{rank}")


def _own_ring(name: str, specs: tuple[BufferSpec, ...], cfg: PipelineConfig,
              rank: int) -> SharedRing:
    """A ring of this rank's own, nameless once mapped: a follower's samples go nowhere
    (another rank reports them), but its device writes them somewhere (and CUDA pins it); a
    joined rank's plans and samples pass through rings of its own."""
    ring = SharedRing(f"{name}-tp{rank}", specs, cfg.limits.num_ring_slots, create=True)
    ring.unlink()
    return ring


def _follow(ctx: StageContext, cfg: PipelineConfig, rank: int, store: dist.Store | None,
            reports: bool) -> None:
    """An engine's rank beyond 0: the same steps as rank 0, in the same order, from the plans
    it forwards. A tensor rank of rank 0's stage has rank 0's samples (broadcast inside
    compute); `reports`: the last stage's first rank, which samples, writes the sampled-token
    ring and reports each step to the scheduler. A rank of a joined stage (on another host:
    ipc/ranks.py) maps none of the engine's rings: its plans bring their slot's entries
    (RemoteStep), and its reports go with theirs to the first rank (joined_stages.py)."""
    joined = cfg.ranks.joined(cfg.ranks.head(cfg.engine) + rank)
    plans, runner, rings = _meet(ctx, cfg, rank, store, joined)
    # Rank 0 may forward the next plan of a ring slot as soon as its own step of that slot
    # ended, before this rank's device is done with the slot's staging buffer: wait for it.
    free = [threading.Event() for _ in range(cfg.limits.num_ring_slots)]
    for event in free:
        event.set()

    def done(step: HostStep, *_: object) -> None:
        free[step.plan.ring_slot].set()

    def take_slot(plan: StepPlan) -> bool:
        stopped_at = None
        while not free[plan.ring_slot].wait(0.1):
            if device.error is not None:  # its reports stopped: so would the slots
                raise RuntimeError("the device failed") from device.error
            if ctx.stop.is_set():  # (draining: see host_loop)
                stopped_at = stopped_at or time.monotonic()
                if time.monotonic() - stopped_at > DRAIN_TIMEOUT_S:
                    return False
        free[plan.ring_slot].clear()
        return True

    on_done: OnDone = done
    layout = cfg.ranks
    if layout.pipeline_parallel_size > 1 and layout.tensor_rank(rank) == 0:
        spans = StageSpans(ctx, layout.stage_of(rank))
        reporter = None
        if reports and joined:  # (to the first rank's relay: joined_stages.py)
            assert store is not None
            reporter = Reporter(ctx, lookup(store, SAMPLES_KEY), cfg.keys.run_secret,
                                rings.sampled)
        elif reports:
            reporter = Reporter(ctx, cfg.sampled_address, cfg.keys.run_secret)

        def on_done(step: HostStep, *counts: Any) -> None:
            done(step)
            spans(step, *counts)
            if reporter is not None:
                reporter(step, *counts)

    device = make_device(runner, rings.sampled if reports or joined
                         else _own_ring(cfg.sampled_ring_name, sampled_specs(cfg.limits), cfg,
                                        rank),
                         on_done)
    ctx.ready(num_kv_blocks=runner.num_blocks)
    if reports and runner.slots.matchers is not None:  # (the sampling rank's, as rank 0's)
        runner.slots.matchers.grammars.warm()
    try:
        device.serve(lambda: host_loop(ctx, plans, runner, rings.steps, device, [], take_slot),
                     ctx.stop)
    finally:
        device.close()
        _leave(runner)


def _meet(ctx: StageContext, cfg: PipelineConfig, rank: int, store: dist.Store | None,
          joined: bool) -> tuple[PullChannel, Runner, StepRings]:
    """A follower's inbox of plans, its runner (built as the engine's ranks meet) and its
    rings: the engine's, which rank 0 made before the ranks met, or on a joined host rings
    of its own, and an inbox on tcp:// whose address the store carries to rank 0 (set before
    the ranks meet, which rank 0 waits for)."""
    if joined:
        assert store is not None
        plans, address = bind_inbox(ctx.zmq, cfg, plans_codec(joined=True))
        store.set(plans_key(rank), address)
    else:
        plans = PullChannel(ctx.zmq, tp_plan_address(cfg, rank), plans_codec(joined=False),
                            bind=True, secret=cfg.keys.run_secret)
    runner = build_runner(cfg, rank, store)
    if not joined:
        return plans, runner, StepRings.open(cfg, create=False)
    limits = cfg.limits
    return plans, runner, StepRings(
        _own_ring(cfg.step_ring_name, step_input_specs(limits), cfg, rank),
        _own_ring(cfg.sampled_ring_name, sampled_specs(limits), cfg, rank))


def _leave(runner: Runner) -> None:
    """Leave the engine's process group (after this rank's last transfers: parallel.py
    PipelineParallel.close). A peer already gone fails them: said, and left all the same."""
    pp = getattr(runner, "pp", None)
    try:
        if pp is not None:
            try:
                pp.close()
            except RuntimeError as exc:
                logger.warning("pipeline stage %d: its last transfers failed as it stopped: "
                               "%s", pp.stage, exc)
    finally:
        if getattr(runner, "tp", None) is not None or pp is not None:
            leave_engine()


def host_loop(ctx: StageContext, plans: PullChannel, runner: Runner, steps: SharedRing,
              device: Device, followers: Sequence[PushChannel | JoinedFollower] = (),
              take_slot: Callable[[StepPlan], bool] | None = None,
              relay: SamplesRelay | None = None) -> None:
    """Receive plans, prepare each and submit it. followers: the engine's other ranks each
    plan is forwarded to (told the last one forwarded, LastStep, when this loop ends);
    take_slot: waits until the plan's ring slot may be prepared (False: give up); a plan
    that came with its slot's entries (RemoteStep: a joined rank) writes them then. relay:
    the first rank's relay of joined samples, whose failure fails this rank. A follower
    (take_slot given) does not end at its own stop flag: it runs the first rank's plans up to
    the LastStep it announces (at most DRAIN_TIMEOUT_S past the flag: that rank may be gone),
    and ends there, setting the flag itself if it was not set."""
    drain = take_slot is not None
    last_sent, last_done, last_wanted, deadline = -1, -1, None, None
    try:
        while True:
            if last_wanted is not None and last_done >= last_wanted:
                ctx.stop.set()  # the first rank stopped; each plan it ran has run here
                return
            if ctx.stop.is_set():
                if not drain:
                    return
                deadline = deadline or time.monotonic() + DRAIN_TIMEOUT_S
                if time.monotonic() > deadline:
                    logger.warning("the first tensor-parallel rank did not announce its last "
                                   "step within %.0f s of the stop", DRAIN_TIMEOUT_S)
                    return
            if device.error is not None:
                raise RuntimeError("the device failed") from device.error
            if relay is not None and relay.error is not None:
                raise RuntimeError("relaying a joined stage's samples failed") from relay.error
            try:  # a foreign frame is refused; a malformed plan of this run is a bug: it raises
                msg = plans.recv_foreign_safe(timeout_ms=100)
            except zmq.ContextTerminated:
                return
            if msg is None:
                continue
            if isinstance(msg, LastStep):
                last_wanted = msg.step_id
                continue
            plan = msg.plan if isinstance(msg, RemoteStep) else msg
            assert isinstance(plan, StepPlan)
            for follower in followers:  # the same step, on every other rank of the engine
                follower.send(plan)
                last_sent = plan.step_id
            if take_slot is not None and not take_slot(plan):
                return
            if isinstance(msg, RemoteStep):
                unpack_plan(msg, steps)
            start = now_ns()
            step = runner.prepare(plan, steps.slot(plan.ring_slot))
            prepared = now_ns()
            device.submit(step)  # on CUDA: launching the step's kernels
            last_done = plan.step_id
            ctx.tracer.span("prepare", start, prepared, "host", {"step": plan.step_id})
            ctx.tracer.span("submit", prepared, now_ns(), "host", {"step": plan.step_id})
    finally:
        for follower in followers:
            follower.send(LastStep(last_sent))
