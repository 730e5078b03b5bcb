"""What the throughput benchmark and its peers' runners share: a workload and one engine's
result (their own module, so that bench_throughput.py and bench_peers.py do not import each
other)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class EngineResult:
    name: str
    seconds: float
    num_tokens: int
    token_ids: list[list[int]]
    # the limit at batch 1: the roofline measured just before it (roofline.Roofline.as_dict)
    roofline: dict[str, Any] | None = field(default=None, compare=False)
    # the limit: tokens a second of its decode steps alone (each batch's prefill step left
    # out), what a long context's KV cache format changes
    decode_tok_s: float | None = field(default=None, compare=False)

    @property
    def output_tok_s(self) -> float:
        return self.num_tokens / self.seconds


@dataclass(frozen=True)
class Workload:
    prompts: list[list[int]]
    output_lens: list[int]
