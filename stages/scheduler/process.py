"""Process entry of the scheduler: moves requests, step plans and sampled ids between the
sockets, the shared rings and the `Scheduler` core."""

from __future__ import annotations

import dataclasses
import gc
import logging
import time
import zlib
from collections import deque

import zmq

from ipc.channels import ForeignFrame, PullChannel, PushChannel, listen_tcp, stage_listen
from ipc.codec import Codec, ProtocolError
from ipc.config import AUTO_DEEP_STEP_MS, PipelineConfig
from ipc.messages import (
    AbortRequest,
    DetokBatch,
    EngineReconcile,
    ForgetClient,
    Members,
    ReconcileAnswer,
    SampledTokens,
    SchedulerStats,
    StageRestarted,
    StopSample,
    TokenizedRequest,
)
from ipc.step import StepRings, read_accepted, read_prompt_logprobs, read_sampled
from stages.peers import Peers, local_members
from stages.process import stage_process
from stages.scheduler.core import RECENT_FINAL_S, Scheduler
from stages.scheduler.pacing import RunAheadDepth, StepPacer, poll_wait_ms
from stages.trace import Tracer, now_ns

logger = logging.getLogger(__name__)


class SchedulerShell:
    """Owns the sockets and rings around one Scheduler core (of engine cfg.engine)."""

    def __init__(self, cfg: PipelineConfig, zctx: zmq.Context, num_blocks: int,
                 tracer: Tracer | None = None, members: Members | None = None,
                 incarnation: int = 0) -> None:
        """members: the stages to send to, for an engine that joined from another host or
        one started again (default: the run's own). incarnation: how many times this engine
        was started again (its detokenizer batches carry it: see EngineDown)."""
        self.cfg, self.incarnation = cfg, incarnation
        self.tracer = tracer or Tracer(None, "scheduler", cfg.engine)
        self.core = Scheduler(cfg.limits, num_blocks, cfg.scheduler.max_waiting,
                              cfg.scheduler.speculative)
        self.rings = StepRings.open(cfg, create=False)
        secret = cfg.keys.run_secret
        # From the other stages: tokenized requests, samples stopped by a stop string.
        # From the launcher: restarts, dead clients, the roster. (All behind the run's secret.)
        self.inbox = PullChannel(
            zctx, cfg.scheduler_address,
            Codec([TokenizedRequest, AbortRequest, StopSample, EngineReconcile, StageRestarted,
                   ForgetClient, Members]), bind=True, secret=secret)
        # (With stages on other hosts: on tcp:// too, for them.)
        self.stage_port = stage_listen(self.inbox, cfg)
        self.results = PullChannel(zctx, cfg.sampled_address, Codec([SampledTokens]), bind=True,
                                   secret=secret)
        # Clients reach the scheduler only to abort (locally, and with --listen over tcp://):
        # their requests go through a tokenizer, which validates them.
        self.remote = PullChannel(zctx, cfg.abort_address, Codec([AbortRequest]), bind=True,
                                  secret=cfg.keys.client_key.encode())
        self.to_executor = PushChannel(zctx, cfg.executor_address, bind=False, secret=secret)
        self.peers = Peers(zctx, secret, members or local_members(cfg))
        self._pins: dict[str, int] = {}  # request id -> the detokenizer that streams it
        # (time, id) of requests whose final output went out: their pins stay as long as the
        # core remembers their finals (a lost worker's recent finals are failed again).
        self._unpin: deque[tuple[float, str]] = deque()
        # The step behind the running one is planned late (pacing.py): when the running one
        # started (this host's clock), and when to plan it.
        self.pacer = StepPacer()
        # (On the CPU device the forward and the host share the cores: a deeper run-ahead
        # would hide nothing there, and still cost its discarded tokens. auto stays at 2.)
        ex = cfg.executor
        apart = ex.timed is not None or ex.device.startswith("cuda")
        self.run_ahead = (RunAheadDepth(cfg.limits.depth, AUTO_DEEP_STEP_MS)
                          if cfg.limits.auto_depth and apart else None)
        self._front_started = 0.0
        self._plan_at = 0.0
        self.poller = zmq.Poller()
        self.poller.register(self.inbox.socket, zmq.POLLIN)
        self.poller.register(self.results.socket, zmq.POLLIN)
        self.poller.register(self.remote.socket, zmq.POLLIN)

    def run_once(self) -> None:
        """Wait for a message (results or requests), then plan and send what can run now.
        Nothing here spins: when no step can be planned, it waits for the next message."""
        events = dict(self.poller.poll(poll_wait_ms(self._plan_at, time.monotonic())))
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
            num_drafted = step.num_drafted_rows
            self.core.on_sampled(msg.step_id, ids, logprobs,
                                 read_prompt_logprobs(ring, msg.num_prompt_logprobs),
                                 read_accepted(ring, num_drafted) if num_drafted else None,
                                 msg.pooled)
            self.core.step_metrics.record(step.num_tokens, msg.device_start, msg.device_end)
            self.pacer.observe(step.num_tokens, msg.device_end - msg.device_start)
            if self.run_ahead is not None:
                self.core.depth = self.run_ahead.observe(msg.device_end - msg.device_start)
            # The next step in flight started when this one ended, by the executor's clock:
            # this host's monotonic one where it runs here (the earlier of it and now: an
            # executor's clock elsewhere can only make the plan early, which is safe).
            self._front_started = min(time.monotonic(), msg.device_end)
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
            elif isinstance(msg, EngineReconcile):
                known = self.core.known_requests(msg.request_ids)
                self.peers.to_tokenizer(msg.rank, ReconcileAnswer(msg.nonce, self.cfg.engine,
                                                                  known))
            elif isinstance(msg, ForgetClient):
                self.core.forget_client(msg.reply_to)
            elif isinstance(msg, StageRestarted) and msg.stage == "detokenizer":
                self._detokenizer_lost(msg.rank)
            elif isinstance(msg, Members):
                self._new_members(msg)

    def _new_members(self, members: Members) -> None:
        before = self.peers.members.detokenizers
        if not self.peers.update(members):
            return
        for rank, address in enumerate(before):
            if address and not (rank < len(members.detokenizers) and members.detokenizers[rank]):
                self._detokenizer_lost(rank)  # one that had joined from another host left

    def _detokenizer_lost(self, rank: int) -> None:
        """Its requests' text state died with it: each ends with an error, sent to the
        worker that takes its place, or to another (an error needs no state)."""
        logger.warning("detokenizer:%d stopped: failing the requests it streamed", rank)
        self.core.fail_requests(lambda rid: self._pins.get(rid) == rank,
                                f"detokenizer:{rank} stopped while it streamed this request's "
                                "text; send it again")

    def _launch_steps(self) -> None:
        self._plan_at = 0.0
        while True:
            if not self._plan_now():
                return
            start = now_ns()
            step = self.core.schedule()
            if step is None:
                return
            self.to_executor.send(step.write(self.rings.steps.slot(step.ring_slot)))
            if len(self.core.inflight) == 1:  # the device was idle: it starts this one now
                self._front_started = time.monotonic()
            self.tracer.span("schedule", start, now_ns(),
                             args={"step": step.step_id, "seqs": len(step.rows),
                                   "depth": self.core.depth})

    def _plan_now(self) -> bool:
        """Whether to plan the next step now: at once with nothing in flight, or where an
        arrival could not join it anyway; behind a running step, at the pacer's time (else
        that time is kept in _plan_at, and the loop waits for it or for a message). With
        pipeline stages, never late: the pacer times the whole model's step, but the first
        stage is free for the next step after its own share of it, and would idle."""
        core = self.core
        if (len(core.inflight) != 1 or core.depth < 2 or core.stages > 1
                or not core.has_room()):
            return True
        at = self.pacer.plan_at(self._front_started, core.inflight[0].num_tokens)
        if time.monotonic() >= at:
            return True
        self._plan_at = at
        return False

    def _flush_outputs(self) -> None:
        start = now_ns()
        infos, deltas, rejected, plain = self.core.take_outputs(columns=True)
        if not (infos or deltas or rejected or plain):
            return
        batches: dict[int, DetokBatch] = {}

        def batch(request_id: str, reply_to: str = "") -> DetokBatch:
            rank = self._shard(request_id, reply_to)
            found = batches.get(rank)
            if found is None:
                found = batches[rank] = DetokBatch([], [], [], self.cfg.engine,
                                                   self.incarnation)
            return found

        for info in infos:
            batch(info.request_id, info.reply_to).new_requests.append(info)
        # A delta per sample per step: its request's pinned worker, whether that one is up
        # asked once per worker here (as _shard asks it; _shard for the rest).
        pins, peers = self._pins, self.peers
        up: dict[int, bool] = {}

        def pinned(rid: str) -> DetokBatch:
            rank = pins.get(rid, -1)  # (-1: not pinned, and never up)
            is_up = up.get(rank)
            if is_up is None:
                is_up = up[rank] = peers.detokenizer_up(rank)
            found = batches.get(rank) if is_up else None
            return batch(rid) if found is None else found

        ended: set[str] = set()
        for delta in deltas:
            pinned(delta.request_id).deltas.append(delta)
            if delta.finish_reason is not None:
                ended.add(delta.request_id)
        tokens, indexes, cached = plain.token_ids, plain.indexes, plain.num_cached_tokens
        for i, rid in enumerate(plain.request_ids):
            pinned(rid).plain.append(rid, tokens[i], indexes[i], cached[i])
        for rej in rejected:
            batch(rej.request_id, rej.reply_to).rejected.append(rej)
        for rank, detok_batch in batches.items():
            if not self.peers.to_detokenizer(rank, detok_batch):
                logger.error("no detokenizer can take the outputs of %d request(s)",
                             len({d.request_id for d in detok_batch.deltas}
                                 | set(detok_batch.plain.request_ids)))
        now = time.monotonic()
        self._unpin.extend((now, rid) for rid in ended | {r.request_id for r in rejected})
        while self._unpin and now - self._unpin[0][0] > RECENT_FINAL_S:
            rid = self._unpin.popleft()[1]
            if rid not in self.core.requests:
                self._pins.pop(rid, None)
        self.tracer.span("outputs", start, now_ns(), args={"deltas": len(deltas) + len(plain)})

    def stats(self) -> SchedulerStats:
        refused = self.inbox.num_refused + self.results.num_refused + self.remote.num_refused
        return dataclasses.replace(self.core.stats(), num_refused_messages=refused,
                                   engine=self.cfg.engine, block_size=self.cfg.limits.block_size,
                                   cache_dtype=self.cfg.executor.kv_cache_dtype)

    def _shard(self, request_id: str, reply_to: str = "") -> int:
        """The detokenizer worker of a request: every message of it goes to the one chosen
        first (pinned: workers may join meanwhile), among those that reach its client."""
        rank = self._pins.get(request_id)
        if rank is not None and self.peers.detokenizer_up(rank):
            return rank
        fits = self.peers.detokenizers_for(reply_to) or [0]  # (0: no reply address known)
        rank = fits[zlib.crc32(request_id.encode()) % len(fits)]
        self._pins[request_id] = rank
        return rank


def run_scheduler(cfg: PipelineConfig, rank: int, parent_pid: int, num_blocks: int,
                  members: Members | None = None, incarnation: int = 0) -> None:
    """rank: the data-parallel engine this scheduler plans for. members, incarnation: see
    SchedulerShell."""
    cfg = cfg.for_engine(rank)
    with stage_process("scheduler", rank, cfg, parent_pid) as ctx:
        shell = SchedulerShell(cfg, ctx.zmq, num_blocks, ctx.tracer, members, incarnation)
        ports = listen_tcp(shell.remote, cfg.remote.listen_host)
        ctx.ready(**ports, stage_port=shell.stage_port)
        # What start-up made lives as long as the process: out of the collector's reach, a
        # full collection walks only what serving made (the sequences, the steps in flight):
        # 2-3 ms where it was 12-19 ms, once every ~100 steps of a batch of 256.
        gc.collect()
        gc.freeze()
        next_stats = 0.0
        while not ctx.stop.is_set():
            shell.run_once()
            if time.monotonic() >= next_stats:
                ctx.report(shell.stats())
                next_stats = time.monotonic() + 0.2
