"""The offline Python API, in the shape vLLM's users know:

    from pipeline import LLM, SamplingParams

    llm = LLM()  # the default model; or LLM(model="/path/to/hf-folder", dtype="bfloat16")
    for out in llm.generate(["Hello", "Bonjour"], SamplingParams(max_tokens=32)):
        print(out.prompt, out.outputs[0].text)
    llm.chat([{"role": "user", "content": "Hi!"}])
    llm.embed(["Hello", "Bonjour"])  # one vector each, pooled as the model says

Works from a plain script without a `__main__` guard (the stages are spawned without
re-running the script: see supervisor.main_hidden) and from a notebook (nothing here needs an event
loop of its own). The pipeline stops when the object is closed, garbage collected, or when
the interpreter exits.
"""

from __future__ import annotations

import dataclasses
import sys
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

from ipc.config import ExecutorConfig, PipelineConfig, SchedulerConfig
from ipc.lora import LoraConfig
from ipc.messages import ChatMessage, SamplingParams
from ipc.model_info import ModelInfo
from ipc.speculative import parse_speculative
from pipeline.runtime.client import CompletionOutput

Conversation = Sequence[dict[str, str] | ChatMessage]


@dataclass
class EmbeddingOutput:
    """One prompt's embedding (LLM.embed): the vector, or None with the error."""

    prompt: Any
    embedding: list[float] | None
    num_prompt_tokens: int
    error: str | None = None


def _text(content: Any) -> str:
    """A message's content: its text, or its text parts' joined (OpenAI's form); an image
    part is refused by name (a multimodal checkpoint runs as its language model only)."""
    if isinstance(content, str):
        return content
    from pipeline.server.openai_parse import IMAGE_PARTS

    parts = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in IMAGE_PARTS:
            raise ValueError(f"an image content part ({kind}) cannot be read: the engine runs "
                             "language models only (vision towers are not implemented)")
        if kind != "text" or not isinstance(part.get("text"), str):
            raise ValueError(f"only text content parts are supported, not {part!r}")
        parts.append(part["text"])
    return "".join(parts)


class LoRARequest(NamedTuple):
    """vLLM's: the adapter a generate() runs under, by its name in `lora_modules` (its id is
    the engine's own; a path, if given, must be the served one)."""

    lora_name: str
    lora_int_id: int = 0
    lora_path: str = ""


class LLM:
    """One running pipeline, for a program's own prompts. Keyword options are the CLI's
    global ones (see `run_pipeline --help`)."""

    # Every default is the config dataclass's (ipc/config.py), as the CLI's flags are.
    def __init__(self, model: str | None = None, *, dtype: str = ExecutorConfig.dtype,
                 device: str = ExecutorConfig.device, max_model_len: int | None = None,
                 max_num_seqs: int = SchedulerConfig.max_num_seqs,
                 max_num_batched_tokens: int = SchedulerConfig.max_num_batched_tokens,
                 kv_cache_memory: int = ExecutorConfig.kv_cache_memory,
                 compile: bool | None = ExecutorConfig.compile,
                 tokenizer_workers: int = PipelineConfig.num_tokenizers,
                 detokenizer_workers: int = PipelineConfig.num_detokenizers,
                 data_parallel_size: int = PipelineConfig.data_parallel_size,
                 quantization: str | None = ExecutorConfig.quantization,
                 kv_cache_dtype: str = ExecutorConfig.kv_cache_dtype,
                 speculative: str | None = None,
                 lora_modules: Sequence[tuple[str, str]] = LoraConfig.modules,
                 max_loras: int = LoraConfig.max_loras,
                 max_lora_rank: int = LoraConfig.max_lora_rank) -> None:
        from pipeline.runtime.launcher import Pipeline
        from pipeline.tools.model_source import resolve_model

        cfg = PipelineConfig(
            model=ModelInfo.from_dir(resolve_model(model), max_model_len),
            scheduler=SchedulerConfig(max_num_seqs=max_num_seqs,
                                      max_num_batched_tokens=max_num_batched_tokens,
                                      speculative=parse_speculative(speculative)),
            executor=ExecutorConfig.for_device(device, dtype=dtype,
                                               kv_cache_memory=kv_cache_memory,
                                               compile=compile, quantization=quantization,
                                               kv_cache_dtype=kv_cache_dtype),
            num_tokenizers=tokenizer_workers, num_detokenizers=detokenizer_workers,
            data_parallel_size=data_parallel_size,
            lora=LoraConfig(modules=tuple((n, str(p)) for n, p in lora_modules),
                            max_loras=max_loras, max_lora_rank=max_lora_rank))
        self._pipeline = Pipeline(cfg)
        # Stops when this object goes, or at the interpreter's exit, whichever comes first
        # (registered first: a start that fails half-way stops what it started too).
        self._finalizer = weakref.finalize(self, self._pipeline.stop)
        self._pipeline.start()
        self._client = self._pipeline.client()

    @property
    def model_name(self) -> str:
        return self._pipeline.cfg.model_name

    def generate(self, prompts: str | Sequence[str] | Sequence[list[int]],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True,
                 lora_request: LoRARequest | None = None) -> list[CompletionOutput]:
        """Answers for prompts (texts or token ids), in their order; each has `prompt`,
        `outputs` (its n samples: `text`, `token_ids`, `finish_reason`), and the counts.
        Errors are per output (`error`). lora_request: every prompt runs under that adapter
        (one of `lora_modules`)."""
        batch: list[Any] = [prompts] if isinstance(prompts, str) else list(prompts)
        return self._run(batch, batch, self._with_lora(sampling_params, lora_request),
                         use_tqdm)

    def _with_lora(self, params: SamplingParams | Sequence[SamplingParams] | None,
                   lora: LoRARequest | None) -> SamplingParams | Sequence[SamplingParams] | None:
        """The params with lora's adapter named (ValueError for one not served)."""
        if lora is None:
            return params
        served = dict(self._pipeline.cfg.lora.modules)
        if lora.lora_name not in served:
            raise ValueError(f"LoRA adapter {lora.lora_name!r} is not among lora_modules "
                             f"({', '.join(served) or 'none'}); adapters load at start only")
        if lora.lora_path and Path(lora.lora_path) != Path(served[lora.lora_name]):
            raise ValueError(f"LoRA adapter {lora.lora_name!r} is served from "
                             f"{served[lora.lora_name]}, not {lora.lora_path}")
        if params is None or isinstance(params, SamplingParams):
            return dataclasses.replace(params or SamplingParams(), lora_name=lora.lora_name)
        return [dataclasses.replace(p, lora_name=lora.lora_name) for p in params]

    def embed(self, prompts: str | Sequence[str] | Sequence[list[int]],
              dimensions: int | None = None, use_tqdm: bool = True) -> list[EmbeddingOutput]:
        """One embedding per prompt (text or token ids), in their order, pooled as the model
        folder says (ipc/pooling.py: its sentence-transformers modules, else the last token,
        normalised); dimensions: a Matryoshka size the model declares (else ValueError).
        Errors are per output (`error`, and `embedding` None)."""
        from ipc.pooling import PoolingConfig

        pooling = PoolingConfig.from_dir(self._pipeline.cfg.model.path)
        why = pooling.check_dimensions(dimensions)
        if why is not None:
            raise ValueError(why)
        batch: list[Any] = [prompts] if isinstance(prompts, str) else list(prompts)
        params = pooling.params()
        outs = self._run(batch, batch, params, use_tqdm)
        return [EmbeddingOutput(
            out.prompt, None if out.samples[0].embedding is None
            else pooling.finish(out.samples[0].embedding, dimensions).tolist(),
            out.num_prompt_tokens, out.error) for out in outs]

    def chat(self, messages: Conversation | Sequence[Conversation],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = True,
             chat_template_kwargs: dict[str, Any] | None = None) -> list[CompletionOutput]:
        """Answers for one conversation or several (lists of {"role", "content"}), through
        the model's chat template; chat_template_kwargs: its extra variables (vLLM's), e.g.
        {"enable_thinking": False}."""
        one = bool(messages) and isinstance(messages[0], (dict, ChatMessage))
        conversations = [messages] if one else list(messages)  # type: ignore[list-item]
        batch = [[m if isinstance(m, ChatMessage) else ChatMessage(m["role"], _text(m["content"]))
                  for m in c] for c in conversations]  # type: ignore[union-attr]
        return self._run(batch, conversations, sampling_params, use_tqdm, chat_template_kwargs)

    def _run(self, batch: list[Any], shown: list[Any],
             params: SamplingParams | Sequence[SamplingParams] | None,
             use_tqdm: bool, template: dict[str, Any] | None = None) -> list[CompletionOutput]:
        from tqdm.auto import tqdm

        params = params if params is not None else SamplingParams()
        bar = tqdm(total=len(batch), unit="prompt", disable=not use_tqdm, file=sys.stderr)
        tokens = [0]

        def finished(out: CompletionOutput) -> None:
            tokens[0] += out.num_output_tokens
            bar.update(1)
            rate = tokens[0] / max(bar.format_dict["elapsed"], 1e-9)
            bar.set_postfix_str(f"{rate:.1f} tok/s")

        try:
            outs = self._client.generate(batch, params, on_finished=finished,
                                         chat_template_kwargs=template)
        finally:
            bar.close()
        for out, prompt in zip(outs, shown, strict=True):
            out.prompt = prompt
        return outs

    def close(self) -> None:
        """Stop the pipeline now (every stage process ends; nothing is left in /dev/shm)."""
        self._client.close()
        self._finalizer()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
