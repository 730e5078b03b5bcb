"""Process entry of the scheduler: moves requests, step plans and sampled ids between the
sockets, the shared rings and the `Scheduler` core."""

from __future__ import annotations

import dataclasses
import logging
import time
import zlib

import zmq

from ipc.channels import ForeignFrame, PullChannel, PushChannel, listen_tcp
from ipc.codec import Codec, ProtocolError
from ipc.config import PipelineConfig
from ipc.messages import (
    AbortRequest,
    DetokBatch,
    EngineReconcile,
    ForgetClient,
    ReconcileAnswer,
    SampledTokens,
    SchedulerStats,
    StageRestarted,
    StopSample,
    TokenizedRequest,
)
from ipc.step import StepRings, read_prompt_logprobs, read_sampled
from stages.process import stage_process
from stages.scheduler.core import Scheduler
from stages.trace import Tracer, now_ns

logger = logging.getLogger(__name__)


class SchedulerShell:
    """Owns the sockets and rings around one Scheduler core (of engine cfg.engine)."""

    def __init__(self, cfg: PipelineConfig, zctx: zmq.Context, num_blocks: int,
                 tracer: Tracer | None = None) -> None:
        self.cfg = cfg
        self.tracer = tracer or Tracer(None, "scheduler", cfg.engine)
        self.core = Scheduler(cfg.limits, num_blocks, cfg.scheduler.max_waiting)
        self.rings = StepRings.open(cfg, create=False)
        secret = cfg.run_secret
        # From the other stages: tokenized requests, samples stopped by a stop string.
        # From the launcher: restarts and dead clients. (All behind the run's secret.)
        self.inbox = PullChannel(
            zctx, cfg.scheduler_address,
            Codec([TokenizedRequest, AbortRequest, StopSample, EngineReconcile, StageRestarted,
                   ForgetClient]), bind=True, secret=secret)
        self.results = PullChannel(zctx, cfg.sampled_address, Codec([SampledTokens]), bind=True,
                                   secret=secret)
        # Clients reach the scheduler only to abort (locally, and with --listen over tcp://):
        # their requests go through a tokenizer, which validates them.
        self.remote = PullChannel(zctx, cfg.abort_address, Codec([AbortRequest]), bind=True,
                                  secret=cfg.client_key.encode())
        self.to_executor = PushChannel(zctx, cfg.executor_address, bind=False, secret=secret)
        self.detoks = [PushChannel(zctx, cfg.detokenizer_address(i), bind=False, secret=secret)
                       for i in range(cfg.num_detokenizers)]
        self.tokenizers = [PushChannel(zctx, cfg.tokenizer_stage_address(i), bind=False,
                                       secret=secret) for i in range(cfg.num_tokenizers)]
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
        while True:
            try:
                msg = self.results.recv_nowait()
            except ForeignFrame as exc:  # not the executor's; one of its frames is a bug
                logger.warning("refused a frame on the sampled-token socket: %s", exc)
                continue
            if msg is None:
                return
            assert isinstance(msg, SampledTokens)
            start = now_ns()
            ring = self.rings.sampled.slot(msg.ring_slot)
            ids, logprobs = read_sampled(ring, msg.num_sampled, msg.num_top_logprobs)
            step = self.core.inflight[0]
            self.core.on_sampled(msg.step_id, ids, logprobs,
                                 read_prompt_logprobs(ring, msg.num_prompt_logprobs))
            self.core.step_metrics.record(step.num_tokens, msg.device_start, msg.device_end)
            self.tracer.span("on_sampled", start, now_ns(), args={"step": msg.step_id})

    def _drain_inbox(self, inbox: PullChannel) -> None:
        while True:
            try:
                msg = inbox.recv_nowait()
            except ProtocolError as exc:  # a foreign frame, or a client's malformed abort
                if not isinstance(exc, ForeignFrame):  # (those are counted already)
                    inbox.num_refused += 1
                logger.warning("refused a frame on %s: %s", inbox.address_name, exc)
                continue
            if msg is None:
                return
            if isinstance(msg, TokenizedRequest):
                self.core.add_request(msg)
            elif isinstance(msg, AbortRequest):
                self.core.abort(msg.request_id)
            elif isinstance(msg, StopSample):
                self.core.stop_sample(msg.request_id, msg.index)
            elif isinstance(msg, EngineReconcile) and 0 <= msg.rank < len(self.tokenizers):
                known = self.core.known_requests(msg.request_ids)
                self.tokenizers[msg.rank].send(ReconcileAnswer(msg.nonce, self.cfg.engine, known))
            elif isinstance(msg, ForgetClient):
                self.core.forget_client(msg.reply_to)
            elif isinstance(msg, StageRestarted) and msg.stage == "detokenizer":
                self._detokenizer_restarted(msg.rank)

    def _detokenizer_restarted(self, rank: int) -> None:
        """Its requests' text state died with it: each ends with an error, queued for the
        worker that takes its place (which needs no state for it)."""
        logger.warning("detokenizer:%d died: failing the requests of its shard", rank)
        self.core.fail_requests(lambda rid: self._shard(rid) == rank,
                                f"detokenizer:{rank} stopped while it streamed this request's "
                                "text; send it again")

    def _launch_steps(self) -> None:
        while True:
            start = now_ns()
            step = self.core.schedule()
            if step is None:
                return
            self.to_executor.send(step.write(self.rings.steps.slot(step.ring_slot)))
            self.tracer.span("schedule", start, now_ns(),
                             args={"step": step.step_id, "seqs": len(step.rows)})

    def _flush_outputs(self) -> None:
        start = now_ns()
        infos, deltas, rejected = self.core.take_outputs()
        if not (infos or deltas or rejected):
            return
        batches = [DetokBatch([], [], [], self.cfg.engine) for _ in self.detoks]
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

    def stats(self) -> SchedulerStats:
        refused = self.inbox.num_refused + self.results.num_refused + self.remote.num_refused
        return dataclasses.replace(self.core.stats(), num_refused_messages=refused,
                                   engine=self.cfg.engine)

    def _shard(self, request_id: str) -> int:
        """Every message of one request goes to the same detokenizer worker."""
        return zlib.crc32(request_id.encode()) % len(self.detoks)


def run_scheduler(cfg: PipelineConfig, rank: int, parent_pid: int, num_blocks: int) -> None:
    """rank: the data-parallel engine this scheduler plans for."""
    cfg = cfg.for_engine(rank)
    with stage_process("scheduler", rank, cfg, parent_pid) as ctx:
        shell = SchedulerShell(cfg, ctx.zmq, num_blocks, ctx.tracer)
        ctx.ready(**listen_tcp(shell.remote, cfg.listen_host))
        next_stats = 0.0
        while not ctx.stop.is_set():
            shell.run_once()
            if time.monotonic() >= next_stats:
                ctx.report(shell.stats())
                next_stats = time.monotonic() + 0.2
