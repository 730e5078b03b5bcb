"""Process entry of the scheduler: moves requests, step plans and sampled ids between the
sockets, the shared rings and the `Scheduler` core."""

from __future__ import annotations

import logging
import time
import zlib
from typing import TYPE_CHECKING

import numpy as np
import zmq

from ipc.channels import PullChannel, PushChannel, listen_tcp
from ipc.codec import Codec, ProtocolError
from ipc.messages import AbortRequest, DetokBatch, SampledTokens, StepPlan, TokenizedRequest
from ipc.rings import sampled_specs, step_input_specs
from ipc.shm import SharedRing
from stages.process import stage_process
from stages.scheduler.core import PlannedStep, Scheduler, SchedulerLimits
from stages.trace import Tracer, now_ns

if TYPE_CHECKING:
    from pipeline.config import PipelineConfig

logger = logging.getLogger(__name__)


def write_step(step: PlannedStep, buf: dict[str, np.ndarray]) -> None:
    """Lay a planned step's bulk inputs into a step-input ring slot. The stamp brackets the
    write, so a reader can tell a slot that is being rewritten (see check_stamp)."""
    buf["stamp"][0] = step.step_id
    rows = step.rows
    lens = [len(r.token_ids) for r in rows]
    num_tokens = sum(lens)
    buf["input_ids"][:num_tokens] = [t for r in rows for t in r.token_ids]
    buf["seq_slot"][: len(rows)] = [r.seq.slot for r in rows]
    buf["query_len"][: len(rows)] = lens
    buf["context_len"][: len(rows)] = [r.context_len for r in rows]
    buf["do_sample"][: len(rows)] = [r.do_sample for r in rows]
    if step.block_updates:
        updates = np.asarray(step.block_updates, dtype=np.int32)  # [n, 3]
        n = len(updates)
        buf["bt_slot"][:n], buf["bt_index"][:n], buf["bt_block"][:n] = updates.T
    buf["stamp"][1] = step.step_id


def make_plan(step: PlannedStep) -> StepPlan:
    return StepPlan(step.step_id, step.ring_slot, len(step.rows), step.num_tokens,
                    len(step.block_updates), len(step.sampled_seqs), step.new_slots)


class SchedulerShell:
    """Owns the sockets and rings around one Scheduler core."""

    def __init__(self, cfg: PipelineConfig, zctx: zmq.Context, num_blocks: int,
                 tracer: Tracer | None = None) -> None:
        self.tracer = tracer or Tracer(None, "scheduler", 0)
        s = cfg.scheduler
        self.core = Scheduler(SchedulerLimits(
            num_blocks, s.block_size, s.max_num_seqs, s.max_num_batched_tokens,
            cfg.model.max_model_len, cfg.max_block_updates, cfg.model.eos_token_ids, s.depth))
        self.steps = SharedRing(cfg.step_ring_name, step_input_specs(
            s.max_num_seqs, s.max_num_batched_tokens, cfg.max_block_updates),
            s.num_ring_slots, create=False)
        self.sampled = SharedRing(cfg.sampled_ring_name, sampled_specs(s.max_num_seqs),
                                  s.num_ring_slots, create=False)
        self.inbox = PullChannel(zctx, cfg.scheduler_address,
                                 Codec([TokenizedRequest, AbortRequest]), bind=True)
        self.results = PullChannel(zctx, cfg.sampled_address, Codec([SampledTokens]), bind=True)
        # Remote clients (--listen) reach the scheduler only to abort: requests from the
        # network go through a tokenizer, which validates them.
        self.remote = PullChannel(zctx, [], Codec([AbortRequest]), bind=True)
        self.to_executor = PushChannel(zctx, cfg.executor_address, bind=False)
        self.detoks = [PushChannel(zctx, cfg.detokenizer_address(i), bind=False)
                       for i in range(cfg.num_detokenizers)]
        self.poller = zmq.Poller()
        self.poller.register(self.inbox.socket, zmq.POLLIN)
        self.poller.register(self.results.socket, zmq.POLLIN)
        self.poller.register(self.remote.socket, zmq.POLLIN)

    def run_once(self) -> None:
        """Wait for a message (results or requests), then plan and send what can run now.
        Nothing here spins: when no step can be planned, it waits for the next message."""
        events = dict(self.poller.poll(50))
        if self.results.socket in events:
            self._drain_results()
        if self.inbox.socket in events:
            self._drain_inbox(self.inbox)
        if self.remote.socket in events:
            self._drain_inbox(self.remote)
        self._launch_steps()
        self._flush_outputs()

    def _drain_results(self) -> None:
        while (msg := self.results.recv_nowait()) is not None:
            assert isinstance(msg, SampledTokens)
            start = now_ns()
            ring = self.sampled.slot(msg.ring_slot)
            n, k = msg.num_sampled, msg.num_top_logprobs
            ids = ring["token_ids"][:n].tolist()
            logprobs = None
            if k >= 0:
                logprobs = (ring["logprob"][:n].tolist(), ring["top_ids"][:n, :k].tolist(),
                            ring["top_logprobs"][:n, :k].tolist())
            step = self.core.inflight[0]
            self.core.on_sampled(msg.step_id, ids, logprobs)
            self.core.step_metrics.record(step.num_tokens, msg.device_start, msg.device_end)
            self.tracer.span("on_sampled", start, now_ns(), args={"step": msg.step_id})

    def _drain_inbox(self, inbox: PullChannel) -> None:
        while True:
            try:
                msg = inbox.recv_nowait()
            except ProtocolError as exc:
                logger.error("dropped a malformed message from a client or tokenizer: %s", exc)
                continue
            if msg is None:
                return
            if isinstance(msg, TokenizedRequest):
                self.core.add_request(msg)
            elif isinstance(msg, AbortRequest):
                self.core.abort(msg.request_id, msg.reason, msg.index)

    def _launch_steps(self) -> None:
        while True:
            start = now_ns()
            step = self.core.schedule()
            if step is None:
                return
            write_step(step, self.steps.slot(step.ring_slot))
            self.to_executor.send(make_plan(step))
            self.tracer.span("schedule", start, now_ns(),
                             args={"step": step.step_id, "seqs": len(step.rows)})

    def _flush_outputs(self) -> None:
        start = now_ns()
        infos, deltas, rejected = self.core.take_outputs()
        if not (infos or deltas or rejected):
            return
        batches = [DetokBatch([], [], []) for _ in self.detoks]
        for info in infos:
            batches[self._shard(info.request_id)].new_requests.append(info)
        for delta in deltas:
            batches[self._shard(delta.request_id)].deltas.append(delta)
        for rej in rejected:
            batches[self._shard(rej.request_id)].rejected.append(rej)
        for chan, batch in zip(self.detoks, batches, strict=True):
            if batch.new_requests or batch.deltas or batch.rejected:
                chan.send(batch)
        self.tracer.span("outputs", start, now_ns(), args={"deltas": len(deltas)})

    def _shard(self, request_id: str) -> int:
        """Every message of one request goes to the same detokenizer worker."""
        return zlib.crc32(request_id.encode()) % len(self.detoks)


def run_scheduler(cfg: PipelineConfig, rank: int, parent_pid: int, num_blocks: int) -> None:
    with stage_process("scheduler", rank, cfg, parent_pid) as ctx:
        shell = SchedulerShell(cfg, ctx.zmq, num_blocks, ctx.tracer)
        ctx.ready(**listen_tcp(shell.remote, cfg.listen_host))
        next_stats = 0.0
        while not ctx.stop.is_set():
            shell.run_once()
            if time.monotonic() >= next_stats:
                ctx.report(shell.core.stats())
                next_stats = time.monotonic() + 0.2
