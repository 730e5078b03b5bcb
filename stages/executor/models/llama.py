"""Llama, Mistral, Qwen2, Qwen3, Phi-3 (ipc/families/llama.py reads their configs): the
pre-norm layer of blocks.py as it is; what sets them apart (biases, Qwen3's per-head q/k
norms, a sliding window, a tied head) is in the spec, as modules that are there or not."""

from __future__ import annotations

from stages.executor.models.base import CausalLM


class Llama(CausalLM):
    pass
