"""lm-eval (`local-completions`, as its users run it against an OpenAI-compatible server) on a
multiple-choice task from a local JSONL file: its log-likelihoods, which it reads from `echo`
with `logprobs` over the prompt's tokens, equal transformers' own scoring of the same token
ids (fp32, within 1e-4)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from test_server import serve

pytestmark = [pytest.mark.live, pytest.mark.slow, pytest.mark.timeout(300)]
DOCS = [
    {"question": "Paris is the capital of", "choices": ["France", "Spain", "Peru"], "answer": 0},
    {"question": "Two plus two is", "choices": ["four", "five"], "answer": 0},
    {"question": "The sky is", "choices": ["blue", "green", "very loud today"], "answer": 0},
    {"question": "Grüße aus", "choices": ["Köln", "Zürich"], "answer": 1},
]


def write_task(folder: Path) -> None:
    (folder / "mc.jsonl").write_text("".join(json.dumps(d) + "\n" for d in DOCS))
    (folder / "tiny_mc.yaml").write_text(f"""task: tiny_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {folder / "mc.jsonl"}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
""")


def test_lm_eval_log_likelihoods_equal_transformers(tiny_model_dir: Path,
                                                    tmp_path: Path) -> None:
    import lm_eval
    from lm_eval.models.openai_completions import LocalCompletionsAPI
    from lm_eval.tasks import TaskManager
    from transformers import AutoModelForCausalLM

    write_task(tmp_path)
    with serve(tiny_model_dir) as server:
        lm = LocalCompletionsAPI(base_url=f"{server.url}/v1/completions", model=server.model,
                                 tokenizer=str(tiny_model_dir), tokenizer_backend="huggingface",
                                 num_concurrent=2, max_retries=1)
        results = lm_eval.simple_evaluate(model=lm, tasks=["tiny_mc"], log_samples=True,
                                          task_manager=TaskManager(include_path=str(tmp_path)))
    samples = results["samples"]["tiny_mc"]
    assert len(samples) == len(DOCS)
    assert "acc,none" in results["results"]["tiny_mc"]
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    scored = 0
    for sample in samples:
        assert len(sample["arguments"]) == len(sample["doc"]["choices"])
        for (context, continuation), response in zip(sample["arguments"], sample["resps"],
                                                     strict=True):
            context_ids, continuation_ids = lm._encode_pair(context, continuation)
            ids = context_ids + continuation_ids
            with torch.no_grad():
                logprobs = model(torch.tensor([ids])).logits[0].log_softmax(-1)
            expected = sum(logprobs[len(context_ids) + j - 1, t].item()
                           for j, t in enumerate(continuation_ids))
            greedy = all(logprobs[len(context_ids) + j - 1].argmax().item() == t
                         for j, t in enumerate(continuation_ids))
            loglikelihood, is_greedy = response[0]
            assert loglikelihood == pytest.approx(expected, abs=1e-4)
            assert is_greedy == greedy
            scored += 1
    assert scored == sum(len(d["choices"]) for d in DOCS)
