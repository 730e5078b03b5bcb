"""logprobs: the sampled token's logprob and the top alternatives equal transformers' own
log-softmax of the same context, through the paged model with chunking and run-ahead."""

from __future__ import annotations

from pathlib import Path

import torch

from ipc.messages import SamplingParams
from stages.inprocess import InProcessEngine


def test_logprobs_match_transformers(tiny_model_dir: Path) -> None:
    from transformers import AutoModelForCausalLM

    prompts = [list(range(3, 40)), [7, 8, 9], list(range(100, 111))]
    engine = InProcessEngine(str(tiny_model_dir), max_num_batched_tokens=16)
    params = [SamplingParams(max_tokens=6, temperature=0.0, logprobs=5, ignore_eos=True),
              SamplingParams(max_tokens=6, temperature=1.0, seed=1, logprobs=0, ignore_eos=True),
              SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)]
    results = engine.run([(str(i), p, sp) for i, (p, sp) in enumerate(zip(prompts, params,
                                                                           strict=True))])
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    for i, k in ((0, 5), (1, 0)):
        out = results[str(i), 0]
        assert len(out.logprobs) == len(out.token_ids) == 6
        ids = torch.tensor([prompts[i] + out.token_ids])
        with torch.no_grad():
            ref = model(ids).logits[0].log_softmax(-1)
        for j, lp in enumerate(out.logprobs):
            row = ref[len(prompts[i]) - 1 + j]
            assert lp.token_id == out.token_ids[j]
            assert abs(lp.logprob - float(row[lp.token_id])) < 1e-4
            assert len(lp.top_ids) == len(lp.top_logprobs) == k
            top = row.topk(k)
            assert lp.top_ids == top.indices.tolist()
            assert all(abs(a - b) < 1e-4 for a, b in zip(lp.top_logprobs, top.values.tolist(),
                                                         strict=True))
        if i == 0:  # greedy: the sampled token is the most likely one
            assert all(lp.top_ids[0] == lp.token_id for lp in out.logprobs)
    assert results["2", 0].logprobs == []  # not asked for
