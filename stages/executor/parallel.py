"""Tensor and pipeline parallelism across an engine's executor ranks, over torch.distributed:
gloo on the CPU, NCCL on CUDA. Runs in each executor process of a run with
`--tensor-parallel-size K` or `--pipeline-parallel-size P` (P x K ranks in one process group
per engine; ipc/ranks.py lays them out, stage after stage of K tensor ranks).

Tensor parallelism (Megatron-style): each rank holds 1/K of every layer of its stage and loads
only that: the layers own their sharding (sharding.py; model.load_model is the one load path
for every K). The query and key/value heads and the MLP's intermediate rows of the
column-parallel projections (qkv, gate/up), the matching input columns of the row-parallel ones
(o, down), after which one all-reduce per attention block and one per MLP block sums the ranks'
parts; 1/K of the vocabulary of the embedding and of the output layer (the logits are gathered
on the stage's first rank, which samples). Norms and RoPE tables are small and replicated, but
for q/k norms over the whole projections (OLMo, OLMoE), split with the heads, their sums of
squares all-reduced (blocks.Attention); each rank's KV cache holds its own heads. With
pipeline stages each stage's K ranks are a group of their own.

Pipeline parallelism: stage s holds a contiguous range of the layers (the first the embedding,
the last the norm, the head and sampling) and their KV cache only. A step's hidden states
[tokens, hidden] (the residual stream: every layer takes and returns it whole) go from each
rank of stage s to the same tensor rank of stage s + 1 (point to point, sent without waiting);
the last stage's first rank samples and reports to the scheduler (it writes the sampled-token
ring: one host), and sends the sampled ids to every rank of stage 0, which resolves the next
steps' placeholders from them: placeholders are resolved where the input ids are embedded.
Stage 0 posts the receive of a step's samples as it finishes the step, and waits on it only
when a later step has a placeholder of one of its slots (the scheduler plans P steps of
disjoint sequences in flight, so in steady decode it never waits).

The scheduler still talks to the engine's first rank alone and the run-ahead protocol is
unchanged: that rank forwards each step plan to the other ranks, every rank reads the step's
ring slot itself and runs its part of the same step. Collectives and point-to-point traffic
are issued only by each process's device thread, in step order. Stages on another host
(--joined-pipeline-stages) map no ring and meet in a TCP store: joined_stages.py.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections import deque
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from ipc.addresses import interface_of

logger = logging.getLogger(__name__)

COLLECTIVE_TIMEOUT = timedelta(seconds=120)  # a rank that died: the others fail, not hang
CLOSE_TIMEOUT_S = 5.0  # a stopping stage waits this long for each of its last transfers


def engine_store(rank: int, size: int, store_path: str, rendezvous: str = "") -> dist.Store:
    """Where the engine's `size` ranks meet: the run directory's file store (one host), or
    with `rendezvous` (HOST:PORT: stages on other hosts) a TCP store there, which rank 0
    serves. Its keys also carry the ranks' own addresses (engine links, stages/executor/
    process.py). Clear text: what its readers trust is checked on the channels it names."""
    if not rendezvous:
        return dist.FileStore(store_path, size)
    host, _, port = rendezvous.rpartition(":")
    return dist.TCPStore(host, int(port), size, is_master=rank == 0,
                         timeout=COLLECTIVE_TIMEOUT, wait_for_workers=False)


def join_engine(rank: int, tensor_size: int, layers: list[range], store: dist.Store,
                device: torch.device, vocab_size: int, host: str = ""
                ) -> tuple[TensorParallel | None, PipelineParallel | None]:
    """Join the engine's process group as its rank `rank` (every rank must call it) through
    `store` (engine_store): this rank's tensor-parallel group (None: K = 1) and its pipeline
    stage (None: one stage), `layers` holding each stage's range. host: the address gloo
    listens on for this rank's peers (stages on other hosts; "": the host name's)."""
    num_stages = len(layers)
    size = tensor_size * num_stages
    backend = "nccl" if device.type == "cuda" else "gloo"
    if host:  # (gloo and NCCL take their interface from the environment only)
        os.environ["NCCL_SOCKET_IFNAME" if backend == "nccl" else "GLOO_SOCKET_IFNAME"] = \
            interface_of(host)
    dist.init_process_group(backend, store=store, rank=rank, world_size=size,
                            timeout=COLLECTIVE_TIMEOUT)
    # Every rank has joined once this returns (NCCL would connect only at the first
    # collective, and a follower maps the rings rank 0 made before it joined).
    dist.barrier(device_ids=[device.index] if device.type == "cuda" else None)
    stage = rank // tensor_size
    tp = None
    if tensor_size > 1:
        group = None
        if num_stages > 1:  # (every rank makes every group, in the same order)
            groups = [dist.new_group(list(range(s * tensor_size, (s + 1) * tensor_size)))
                      for s in range(num_stages)]
            group = groups[stage]
        tp = TensorParallel(rank % tensor_size, tensor_size, vocab_size, group,
                            stage * tensor_size)
    pp = None
    if num_stages > 1:
        # The samples travel on a group of their own: NCCL ignores tags, and on one pair's
        # communicator a sample going back would queue behind the next hidden states.
        samples = dist.new_group(list(range(size)))
        pp = PipelineParallel(stage, num_stages, layers[stage], rank % tensor_size,
                              tensor_size, samples)
    logger.info("executor rank %d of %d (%s): stage %d of %d (layers %d-%d), tensor rank %d "
                "of %d", rank, size, backend, stage, num_stages, layers[stage].start,
                layers[stage].stop - 1, rank % tensor_size, tensor_size)
    return tp, pp


def leave_engine() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


@dataclasses.dataclass
class TensorParallel:
    rank: int  # within its stage's group
    size: int
    vocab_size: int  # the model's, before padding to a multiple of size
    group: Any = None  # the stage's ranks (None: the whole process group, one stage)
    root: int = 0  # the group's first rank, in the process group (where logits gather)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(x, group=self.group)
        return x

    def gather_logits(self, logits: torch.Tensor) -> torch.Tensor | None:
        """This rank's logits [S, V/K] -> all of them [S, V] on the group's first rank (None
        elsewhere)."""
        parts = ([torch.empty_like(logits) for _ in range(self.size)] if self.rank == 0
                 else None)
        dist.gather(logits.contiguous(), parts, dst=self.root, group=self.group)
        if parts is None:
            return None
        return torch.cat(parts, dim=1)[:, :self.vocab_size]

    def broadcast(self, x: torch.Tensor) -> torch.Tensor:
        dist.broadcast(x, src=self.root, group=self.group)
        return x


# Tags of the two kinds of point-to-point traffic (each pair of ranks carries one kind in
# each direction today; the tags keep them apart whatever the layout)
HIDDEN_TAG, SAMPLES_TAG = 1, 2


@dataclasses.dataclass
class PipelineParallel:
    """This rank's pipeline stage: its layers, and the traffic between stages (see the
    module's docstring). Sends are not waited on at once: each keeps its tensor alive
    until it completed (checked as later ones are sent)."""

    stage: int
    size: int
    layers: range  # the model's layers this stage holds
    tensor_rank: int = 0
    tensor_size: int = 1
    samples_group: Any = None  # (None: the process group's)

    def __post_init__(self) -> None:
        self._sends: deque[tuple[Any, torch.Tensor]] = deque()
        # Stage 0: the samples of each step it ran, on their way: (step id, the slots that
        # sampled, the receive, its buffer), in step order; and each slot's newest such step
        # (an entry may outlive its receive: it then names a step already settled)
        self._samples: deque[tuple[int, torch.Tensor, Any, torch.Tensor]] = deque()
        self._pending_step: dict[int, int] = {}
        # Seconds in steps, and of them blocked on the stage before (hidden states) or on the
        # last one (samples): the stage's bubble, logged as it closes
        self.stepped_s = self.waited_s = 0.0
        self.num_steps = 0
        # (step, its samples' time on the timed instrument) of those kept before asked for
        self._kept_at: deque[tuple[int, int]] = deque(maxlen=1024)

    @property
    def first(self) -> bool:
        return self.stage == 0

    @property
    def last(self) -> bool:
        return self.stage == self.size - 1

    def _peer(self, stage: int, tensor_rank: int | None = None) -> int:
        return stage * self.tensor_size + (self.tensor_rank if tensor_rank is None
                                           else tensor_rank)

    def _send(self, x: torch.Tensor, dst: int, tag: int, group: Any = None) -> None:
        self._sends.append((dist.isend(x, dst, group=group, tag=tag), x))
        while self._sends and self._sends[0][0].is_completed():
            self._sends.popleft()

    def stepped(self, seconds: float) -> None:
        """A step ran on this stage for `seconds` (waits included)."""
        self.stepped_s += seconds
        self.num_steps += 1

    def fewest(self, num_blocks: int, device: torch.device) -> int:
        """The fewest KV blocks any rank of the engine holds (every rank calls it once, as it
        sizes its cache): the scheduler plans with that many, and every rank allocates it."""
        count = torch.tensor([num_blocks], dtype=torch.int64, device=device)
        dist.all_reduce(count, op=dist.ReduceOp.MIN)
        return int(count.item())

    def send_hidden(self, x: torch.Tensor) -> None:
        """A step's hidden states [T, hidden] to the next stage."""
        self._send(x.contiguous(), self._peer(self.stage + 1), HIDDEN_TAG)

    def recv_hidden(self, rows: int, hidden: int, dtype: torch.dtype,
                    device: torch.device) -> torch.Tensor:
        """The hidden states [rows, hidden] of this step, from the previous stage."""
        x = torch.empty(rows, hidden, dtype=dtype, device=device)
        began = time.perf_counter()
        dist.recv(x, self._peer(self.stage - 1), tag=HIDDEN_TAG)
        self.waited_s += time.perf_counter() - began
        return x

    def send_samples(self, tokens: torch.Tensor, at_ns: int | None = None) -> None:
        """The last stage's first rank: a step's sampled ids [X] (int64) to every rank of
        stage 0 (none when the step sampled nothing: stage 0 expects none then); `at_ns`:
        the timed instrument's, when they exist on its clock (sent after them)."""
        if len(tokens):
            if at_ns is not None:
                tokens = torch.cat([tokens, tokens.new_tensor([at_ns])])
            tokens = tokens.contiguous()
            for rank in range(self.tensor_size):
                self._send(tokens, self._peer(0, rank), SAMPLES_TAG, self.samples_group)

    def expect_samples(self, step_id: int, slots: torch.Tensor, host_slots: list[int],
                       last_sampled: torch.Tensor, timed: bool = False) -> None:
        """Stage 0, as it finishes step `step_id`: post the receive of its samples, one per
        sampled position (slots, on the device; host_slots, the same on the host; `timed`:
        and the time they exist at, on the timed instrument). Samples that came already are
        kept as their slots' last ones now (steps no later step waits on, prompt scoring
        alone, would otherwise pile up)."""
        while self._samples and self._samples[0][2].is_completed():
            self._keep(self._samples.popleft(), last_sampled)
        if not host_slots:
            return
        buf = torch.empty(len(host_slots) + timed, dtype=torch.int64, device=slots.device)
        work = dist.irecv(buf, self._peer(self.size - 1, 0), group=self.samples_group,
                          tag=SAMPLES_TAG)
        # (slots is a view of the step's staging buffer, which a later step rewrites)
        self._samples.append((step_id, slots.clone(), work, buf))
        for slot in host_slots:
            self._pending_step[slot] = step_id

    def settle(self, slots: list[int], last_sampled: torch.Tensor) -> int:
        """Stage 0, before a step whose placeholders are these slots': wait for the samples
        of every step up to the newest one that sampled any of them, and keep them as the
        slots' last samples (in step order, so the newest sample of a slot wins). Returns
        the time the newest of them exists at, on the timed instrument (else 0)."""
        pending = self._pending_step
        upto = max((pending.get(slot, -1) for slot in slots), default=-1)
        at_ns = 0
        kept = self._kept_at  # (samples kept already may be the newest it needs; in step
        while kept and kept[0][0] <= upto:  # order, so their times are too)
            at_ns = kept.popleft()[1]
        while self._samples and self._samples[0][0] <= upto:
            entry = self._samples.popleft()
            began = time.perf_counter()
            entry[2].wait()
            self.waited_s += time.perf_counter() - began
            at_ns = max(at_ns, self._keep(entry, last_sampled, early=False))
        return at_ns

    def _keep(self, entry: tuple[int, torch.Tensor, Any, torch.Tensor],
              last_sampled: torch.Tensor, early: bool = True) -> int:
        """A step's received samples as its slots' last ones; their time on the timed
        instrument (else 0), which `early` (before a step asked for them) keeps for it."""
        step_id, where, _, buf = entry
        at_ns = 0
        if len(buf) > len(where):  # (the timed instrument's time, after the ids)
            at_ns = int(buf[-1])
            if early:  # (a bounded record: one no step asks for is long past)
                self._kept_at.append((step_id, at_ns))
            buf = buf[:-1]
        last_sampled[where] = buf
        return at_ns

    def send_time(self, at_ns: int) -> None:
        """The timed instrument's stand-in for hidden states: when this stage's part of the
        step ends, on the instrument's clock, to the next stage."""
        self.send_hidden(torch.tensor([[at_ns]], dtype=torch.int64))

    def recv_time(self) -> int:
        """When the previous stage's part of this step ends (the timed instrument)."""
        return int(self.recv_hidden(1, 1, torch.int64, torch.device("cpu"))[0, 0])

    def close(self, timeout_s: float = CLOSE_TIMEOUT_S) -> None:
        """Before the rank leaves the group: the first stage waits for the samples of every
        step it ran (the last stage runs up to the same last step and sends them: leaving
        before would fail its send), and every rank for what it sent to go out. Each wait is
        bounded: a peer that died sends and receives nothing more."""
        logger.info("pipeline stage %d: %d steps in %.2f s, of which %.2f s waiting on the "
                    "other stages", self.stage, self.num_steps, self.stepped_s, self.waited_s)
        bound = timedelta(seconds=timeout_s)
        for work in [entry[2] for entry in self._samples] + [w for w, _ in self._sends]:
            work.wait(bound)
        self._samples.clear()
        self._sends.clear()
