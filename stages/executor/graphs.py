"""Decode steps replayed as CUDA graphs, one per padded step size. Runs in the executor process.

An eager (or regionally compiled) decode step is hundreds of kernel launches; from the host
they take longer than the GPU takes to run them, so the GPU would wait on launches however
well the scheduler runs ahead. A graph is launched in one call.

What a graph needs, and how a step provides it:
- static inputs: one buffer per bucket holds the forward's packed inputs (token ids with
  their placeholders, positions, slots and the backend's `graph_fields`: the first fields of
  the staging layout, padded to the bucket, staging.py) and the rows whose logits are wanted.
  A step copies them in on the compute stream, device to device, so a copy cannot overtake
  the previous replay that reads the same buffer (one set per bucket is enough);
- static state: the block table, the last samples, the KV cache and the weights never move;
- what varies from step to step stays outside: slot updates (block table, sampling
  parameters) before the replay, sampling after it, on the replay's logits.
Inside the graph: placeholder ids resolved from the last samples, the attention metadata,
the forward, the wanted rows' logits.

A bucket is captured the second time a decode step of that size comes (the first compiles
it), after a warm-up on the capture stream; capturing synchronises the device once, so a
long run pays one wait per bucket, never more (`stats.captures`). Without CUDA (the tests on
this machine) the same static buffers and the same captured function run as plain calls
(`capture=False`): everything but the capture itself is exercised.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from stages.executor.backends.base import AttentionBackend
from stages.executor.staging import DeviceStep, StagingLayout
from stages.executor.step_inputs import HostStep

logger = logging.getLogger(__name__)

# forward(static input views, static wanted rows) -> logits [bucket, V] (the model's dtype)
GraphForward = Callable[[DeviceStep, torch.Tensor], torch.Tensor]


@dataclass
class GraphStats:
    captures: int = 0
    replays: int = 0
    buckets: list[int] = field(default_factory=list)
    failed: list[int] = field(default_factory=list)  # buckets whose capture failed: ordinary


class _BucketGraph:
    """fields: the packed fields the graph reads, in staging order (they come first: one
    contiguous copy)."""

    def __init__(self, counts: dict[str, int], fields: tuple[str, ...], layout: StagingLayout,
                 device: torch.device) -> None:
        where = layout.offsets(counts)
        assert list(where)[:len(fields)] == list(fields), "graph fields must be packed first"
        self.nbytes = where["logits_indices"][0]  # the graph's fields end there
        self.counts = {name: counts[name] for name in fields}
        # Ordinary tensors, like the staging buffers the ordinary path's inputs view: made in
        # compute()'s inference mode they would differ in dispatch keys, and the compiled
        # layers would compile once more for every bucket.
        with torch.inference_mode(False):
            self.inputs = torch.zeros(self.nbytes, dtype=torch.uint8, device=device)
            self.wanted = torch.zeros(counts["input_ids"], dtype=torch.int64, device=device)
        self.views = DeviceStep({name: self.inputs[offset:offset + count * 8].view(torch.int64)
                                 for name, (offset, count, _) in where.items() if name in fields})
        self.graph: torch.cuda.CUDAGraph | None = None
        self.logits: torch.Tensor | None = None

    def load(self, packed: torch.Tensor, wanted: torch.Tensor) -> None:
        """This step's inputs into the static buffers (device to device, on this stream).
        Wanted rows past the step's keep earlier values: valid rows, logits not read."""
        self.inputs.copy_(packed[:self.nbytes])
        self.wanted[:len(wanted)].copy_(wanted)


class DecodeGraphs:
    """The decode steps of one runner, by bucket (padded step size)."""

    def __init__(self, forward: GraphForward, backend: AttentionBackend, layout: StagingLayout,
                 device: torch.device, capture: bool) -> None:
        self.forward, self.device, self.capture = forward, device, capture
        self.backend, self.layout = backend, layout
        self.fields = tuple(backend.graph_fields)
        self.stats = GraphStats()
        self._graphs: dict[int, _BucketGraph] = {}
        self._seen: Counter[int] = Counter()
        self._failed: set[int] = set()
        self._pool = torch.cuda.graph_pool_handle() if capture else None
        self._stream = torch.cuda.Stream(device) if capture else None

    def eligible(self, step: HostStep) -> bool:
        """The steps the backend replays (decode-only ones: their sizes are one bucket
        each)."""
        return self.backend.graph_eligible(step.decode_only, step.counts["plp_index"])

    def run(self, step: HostStep, packed: torch.Tensor, wanted: torch.Tensor
            ) -> torch.Tensor | None:
        """The logits [len(wanted), V] of the step by its bucket's graph, or None when the
        step should run the ordinary way (not eligible, or its bucket's first step)."""
        if not self.eligible(step):
            return None
        bucket = step.counts["input_ids"]
        g = self._graphs.get(bucket)
        if g is None:
            self._seen[bucket] += 1
            if self._seen[bucket] < 2 or bucket in self._failed:
                return None  # the ordinary run compiles the bucket first
            g = _BucketGraph(step.counts, self.fields, self.layout, self.device)
            g.load(packed, wanted)
            if not self._capture(g):
                return None
            self._graphs[bucket] = g
        else:
            assert g.counts == {name: step.counts[name] for name in self.fields}, (
                "a bucket's packed layout changed")
            g.load(packed, wanted)
        self.stats.replays += 1
        if g.graph is not None:
            g.graph.replay()
            assert g.logits is not None
            logits = g.logits
        else:
            logits = self.forward(g.views, g.wanted)
        return logits[:len(wanted)]

    def _capture(self, g: _BucketGraph) -> bool:
        """Capture g's graph (on CUDA); False if that failed: the bucket then runs the
        ordinary way for good, and the run goes on."""
        bucket = g.counts["input_ids"]
        if self.capture:
            try:
                self._capture_cuda(g)
            except Exception:
                logger.exception("capturing the decode graph of %d tokens failed; that step "
                                 "size runs without a graph", bucket)
                self._failed.add(bucket)
                self.stats.failed.append(bucket)
                return False
        self.stats.captures += 1
        self.stats.buckets.append(bucket)
        return True

    def _capture_cuda(self, g: _BucketGraph) -> None:
        assert self._stream is not None
        stream, current = self._stream, torch.cuda.current_stream(self.device)
        stream.wait_stream(current)  # the static inputs were loaded on the current stream
        # A compile now would sync inside the capture: say so by name instead.
        with torch.compiler.set_stance("fail_on_recompile"):
            # Warm up on the capture stream (BLAS handles and workspaces are per stream). The
            # forward is idempotent: it writes the same keys and values where the replay will.
            with torch.cuda.stream(stream):
                self.forward(g.views, g.wanted)
            graph = torch.cuda.CUDAGraph()
            # thread_local: the notifier and grammar threads keep waiting on their events.
            with torch.cuda.graph(graph, pool=self._pool, stream=stream,
                                  capture_error_mode="thread_local"):
                logits = self.forward(g.views, g.wanted)
        current.wait_stream(stream)
        g.graph, g.logits = graph, logits
        logger.info("captured the decode graph of %d tokens (%d so far)",
                    g.counts["input_ids"], self.stats.captures + 1)
