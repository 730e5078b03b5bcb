"""The CUDA path: streams, events and page-locked rings. Skipped without a GPU; run by
scripts/gpu_check on a machine that has one."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch
from live import live_config, running
from tiny_model import hf_greedy

from ipc.messages import SamplingParams
from stages.inprocess import InProcessEngine

pytestmark = [pytest.mark.cuda, pytest.mark.timeout(300),
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

TEXTS = ["The quick brown fox", "Paged attention", "Héllo wörld 🚀", "def main():",
         "Continuous batching lets new requests join. " * 3, "a", "日本語", "Grüße aus Köln."]


def _prompts(model_dir: Path) -> list[list[int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    return [tok(t)["input_ids"] for t in TEXTS]


def test_paged_model_on_cuda_matches_transformers(tiny_model_dir: Path) -> None:
    prompts = _prompts(tiny_model_dir)
    expected = hf_greedy(tiny_model_dir, prompts, 16)
    engine = InProcessEngine(str(tiny_model_dir), max_num_batched_tokens=16, device="cuda")
    got = engine.generate(prompts, SamplingParams(max_tokens=16, temperature=0.0,
                                                  ignore_eos=True))
    assert [g[:len(e)] for g, e in zip(got, expected, strict=True)] == expected


@pytest.mark.parametrize("depth", [1, 2])
def test_live_pipeline_on_cuda_overlapped_equals_synchronous(tiny_model_dir: Path,
                                                              depth: int) -> None:
    prompts = _prompts(tiny_model_dir)
    expected = hf_greedy(tiny_model_dir, prompts, 12)
    cfg = live_config(tiny_model_dir, depth=depth, device="cuda", max_num_batched_tokens=16)
    with running(cfg) as pipe:
        outs = pipe.client().generate(prompts, SamplingParams(max_tokens=12, temperature=0.0))
    assert [o.token_ids for o in outs] == expected


def test_stream_and_abort_on_cuda(tiny_model_dir: Path) -> None:
    with running(live_config(tiny_model_dir, device="cuda")) as pipe:
        client = pipe.client()

        async def run() -> str | None:
            reason = None
            async for out in client.stream([5, 6, 7], SamplingParams(max_tokens=400,
                                                                     ignore_eos=True),
                                           request_id="x"):
                if out.num_output_tokens >= 5 and reason is None:
                    client.abort("x")
                reason = out.finish_reason
            return reason

        assert asyncio.run(run()) == "abort"
