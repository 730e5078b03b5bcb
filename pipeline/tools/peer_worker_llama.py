"""llama.cpp on one `bench throughput` job, through llama-cpp-python's low-level batch API:
`python peer_worker_llama.py JOB RESULT`.

Runs in the llama.cpp peer venv, by path, so it imports nothing from this project. JOB (JSON):
prompts (token ids), output_lens, model (a GGUF of the job's dtype), dtype, batch_size,
threads. RESULT (JSON): token_ids per prompt and seconds of the timed generation (model load
and a small warm-up excluded), and notes (what was changed from llama.cpp's defaults).

On a CPU with AMX, llama.cpp's repacked Q4/Q8 weight buffers (its "extra buffer types")
crash; the model loads without them there (`use_extra_bufts = False`, llama-cli's
`--no-repack`), which the notes say.

Static batches of batch_size prompts, like hf-static: one llama_decode carries the whole
prefill of a batch, then one llama_decode per step carries the next token of each of its
sequences still generating, each under its own seq_id, with logits for that last token only;
greedy argmax. The next batch starts when the batch's longest output is done (no refill)."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import gguf
import llama_cpp as lc
import numpy as np

# The KV cache in the weights' dtype, as our pipeline keeps it (llama.cpp's default is F16).
KV_TYPES = {"float32": gguf.GGMLQuantizationType.F32, "bfloat16": gguf.GGMLQuantizationType.BF16}

Entry = tuple[int, int, int, bool]  # seq_id, position, token, whether to return its logits


class Engine:
    """A loaded model and a context with room for batch_size sequences of the longest length."""

    def __init__(self, job: dict[str, Any]) -> None:
        lc.llama_backend_init()
        model_params = lc.llama_model_default_params()
        self.notes = ""
        if _has_amx():
            model_params.use_extra_bufts = False
            self.notes = ("loaded with use_extra_bufts = False (--no-repack): llama.cpp's "
                          "repacked Q4/Q8 buffers crash on this AMX CPU")
        self.model = lc.llama_model_load_from_file(job["model"].encode(), model_params)
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {job['model']}")
        longest = max(len(p) + n for p, n in zip(job["prompts"], job["output_lens"], strict=True))
        n_ctx = job["batch_size"] * longest
        params = lc.llama_context_default_params()
        params.n_ctx = params.n_batch = n_ctx  # a batch's whole prefill in one llama_decode
        params.n_seq_max = job["batch_size"]
        params.n_threads = params.n_threads_batch = job["threads"]
        params.type_k = params.type_v = int(KV_TYPES[job["dtype"]])
        if job.get("kv_cache") == "q8_0":  # (-ctk q8_0 -ctv q8_0: a quantized V needs its
            # flash attention, -fa on)
            params.type_k = params.type_v = int(gguf.GGMLQuantizationType.Q8_0)
            params.flash_attn_type = lc.LLAMA_FLASH_ATTN_TYPE_ENABLED
        self.ctx = lc.llama_init_from_model(self.model, params)
        if not self.ctx:
            raise RuntimeError(f"llama.cpp could not make a context of {n_ctx} tokens")
        self.n_vocab = lc.llama_vocab_n_tokens(lc.llama_model_get_vocab(self.model))
        self.batch = lc.llama_batch_init(n_ctx, 0, 1)

    def decode(self, entries: list[Entry]) -> list[int]:
        """One llama_decode of ``entries``; the greedy next token of each that wants logits."""
        self.batch.n_tokens = len(entries)
        for i, (seq, pos, token, wants_logits) in enumerate(entries):
            self.batch.token[i] = token
            self.batch.pos[i] = pos
            self.batch.n_seq_id[i] = 1
            self.batch.seq_id[i][0] = seq
            self.batch.logits[i] = wants_logits
        rc = lc.llama_decode(self.ctx, self.batch)
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc} on {len(entries)} tokens")
        return [self.argmax(i) for i, entry in enumerate(entries) if entry[3]]

    def argmax(self, i: int) -> int:
        logits = lc.llama_get_logits_ith(self.ctx, i)
        return int(np.ctypeslib.as_array(logits, shape=(self.n_vocab,)).argmax())

    def generate(self, prompts: list[list[int]], out_lens: list[int]) -> list[list[int]]:
        """One static batch, from an empty KV cache."""
        lc.llama_memory_clear(lc.llama_get_memory(self.ctx), True)
        prefill = [(s, pos, token, pos == len(p) - 1)
                   for s, p in enumerate(prompts) for pos, token in enumerate(p)]
        outs = [[token] for token in self.decode(prefill)]
        while live := [s for s, n in enumerate(out_lens) if len(outs[s]) < n]:
            step = [(s, len(prompts[s]) + len(outs[s]) - 1, outs[s][-1], True) for s in live]
            for s, token in zip(live, self.decode(step), strict=True):
                outs[s].append(token)
        return outs


def _has_amx() -> bool:
    try:
        return "amx_tile" in Path("/proc/cpuinfo").read_text().split()
    except OSError:
        return False


def main(job_path: str, result_path: str) -> None:
    job = json.loads(Path(job_path).read_text())
    engine = Engine(job)
    engine.generate([[5, 6, 7]], [2])  # warm up
    size, ids = job["batch_size"], []
    start = time.perf_counter()
    for lo in range(0, len(job["prompts"]), size):
        ids += engine.generate(job["prompts"][lo:lo + size], job["output_lens"][lo:lo + size])
    seconds = time.perf_counter() - start
    Path(result_path).write_text(json.dumps({"token_ids": ids, "seconds": seconds,
                                             "notes": engine.notes}))


if __name__ == "__main__":
    main(*sys.argv[1:])
