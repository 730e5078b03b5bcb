"""Command line of `scripts/run_pipeline`: the demo (no command) and `generate`.
Runs in the user's process, which owns the pipeline; prints are allowed here only."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import math
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any, Literal

from ipc.addresses import RemoteSettings
from ipc.config import (
    KV_CACHE_DTYPES,
    QUANTIZATIONS,
    TOOL_CALL_PARSERS,
    ExecutorConfig,
    PipelineConfig,
    RunKeys,
    SchedulerConfig,
    ServerOptions,
    parse_depth,
)
from ipc.errors import ConfigError
from ipc.lora import LoraConfig, parse_lora_module, runtime_updating
from ipc.messages import ChatMessage, LogitBias, SamplingParams, StructuredOutputs, TokenLogprob
from ipc.model_info import ModelInfo
from ipc.params import RequestError, validate_params
from ipc.ranks import parse_partition
from ipc.speculative import parse_speculative
from ipc.units import format_bytes, parse_bytes
from pipeline.runtime.client import KEY_ENV, CompletionOutput, PipelineClient, PipelineError

DEMO_PROMPTS = [
    "What is the capital of France? Answer in one sentence.",
    "Write a haiku about the sea.",
    "Give three tips for writing readable Python code.",
    "Explain in two sentences why the sky is blue.",
    "What is 12 times 7?",
    "Name three planets of the solar system.",
]


class _Help(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """The description as written, and each option's default (read from the config
    dataclasses), unless its help already says what the default means."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if "(default" in text or "default:" in text.lower():
            return text
        return super()._get_help_string(action)


def _version() -> str:
    import pipeline

    return str(pipeline.__version__)


def add_global_options(p: argparse.ArgumentParser, suppress: bool) -> None:
    d = (lambda v: argparse.SUPPRESS) if suppress else (lambda v: v)
    p.add_argument("--model", default=d(None),
                   help="local Hugging Face folder (Llama family) or GGUF file (llama, qwen2, "
                   "qwen3; F32/F16/BF16, Q8_0, Q4_0/Q4_1, Q5_0/Q5_1, Q4_K-Q6_K: quantized ones "
                   "stay quantized); default: SmolLM2-135M-Instruct, converted once into "
                   "$LLM_PIPELINE_CACHE")
    p.add_argument("--dtype", default=d(ExecutorConfig.dtype), choices=["float32", "bfloat16"])
    p.add_argument("--quantization", default=d(ExecutorConfig.quantization),
                   choices=list(QUANTIZATIONS),
                   help="quantize the weights at load (CPU, eager forward, AVX512-VNNI): int8 "
                        "= 8-bit codes with a scale and a minimum per 32 inputs; int4 = 4-bit "
                        "codes with a scale and a minimum per 32 (llama.cpp's Q4_1), the head "
                        "at int8. Activations stay in --dtype")
    p.add_argument("--device", default=d(ExecutorConfig.device),
                   help="cpu, cuda[:N], or timed:A,B[,S] (a measuring instrument: no model, each "
                        "step takes A + B*tokens ms on its device after S ms of host work to "
                        "launch it, and emits deterministic tokens)")
    p.add_argument("--trace", default=d(None), metavar="FILE",
                   help="write a Chrome-trace timeline of all stages (open it in Perfetto)")
    p.add_argument("--tokenizer-workers", type=int, default=d(PipelineConfig.num_tokenizers))
    p.add_argument("--detokenizer-workers", type=int,
                   default=d(PipelineConfig.num_detokenizers))
    p.add_argument("--max-num-seqs", type=int, default=d(SchedulerConfig.max_num_seqs))
    p.add_argument("--max-num-batched-tokens", type=int,
                   default=d(SchedulerConfig.max_num_batched_tokens))
    p.add_argument("--max-model-len", type=int, default=d(None),
                   help="(default: the model's own context length)")
    p.add_argument("--kv-cache-memory", default=d(format_bytes(ExecutorConfig.kv_cache_memory)),
                   help="bytes, or e.g. 2GiB, 512MiB")
    p.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES,
                   default=d(ExecutorConfig.kv_cache_dtype),
                   help="the KV cache's format: auto (the model's dtype); int8 (an fp16 scale "
                        "per token and KV head, 1.94x the tokens of bf16 at head size 64); "
                        "fp8 (= fp8_e4m3) or fp8_e5m2 (no scale: 2x the tokens). The 8-bit "
                        "formats run on the CPU kernels' forward"),
    p.add_argument("--compile", action=argparse.BooleanOptionalAction,
                   default=d(ExecutorConfig.compile),
                   help="torch.compile the model (TorchInductor; artefacts cached in "
                        "$LLM_PIPELINE_CACHE/inductor). Default: on for CUDA, off on the CPU, "
                        "where it measured slower (docs/BENCHMARKS.md)")
    p.add_argument("--tensor-parallel-size", type=int,
                   default=d(ExecutorConfig.tensor_parallel_size), metavar="K",
                   help="K executor processes, each holding 1/K of every layer (heads, MLP "
                        "rows, vocabulary), summed by torch.distributed all-reduces (gloo on "
                        "the CPU, NCCL on CUDA, a GPU per rank); eager only")
    p.add_argument("--pipeline-parallel-size", type=int,
                   default=d(ExecutorConfig.pipeline_parallel_size), metavar="P",
                   help="P stages of consecutive layers (each of --tensor-parallel-size ranks, "
                        "P x K executor processes): each rank loads only its layers and their "
                        "KV cache; hidden states pass stage to stage, and the scheduler keeps "
                        "P steps of disjoint sequences in flight so every stage runs")
    p.add_argument("--pipeline-layer-partition", type=parse_partition,
                   default=d(ExecutorConfig.pipeline_layer_partition), metavar="N,N,...",
                   help="the layers of each stage, in order (e.g. 9,7); default: even, the "
                        "remainder to the stages before the last")
    p.add_argument("--joined-pipeline-stages", type=int,
                   default=d(ExecutorConfig.joined_pipeline_stages), metavar="N",
                   help="the last N pipeline stages of each engine run on another host, which "
                        "joins with `run_pipeline stage pipeline` (needs --listen and "
                        "--stage-key); each engine starts once its host has joined")
    p.add_argument("--data-parallel-size", type=int,
                   default=d(PipelineConfig.data_parallel_size), metavar="D",
                   help="D engines (a scheduler and its executor each, a whole model each) "
                        "behind the same tokenizers; each request goes to one, by --router")
    p.add_argument("--router", choices=["prefix", "load"], default=d(PipelineConfig.router),
                   help="with several engines: 'prefix' sends a request to the engine that "
                        "holds the longest part of its prompt unless that one is far busier; "
                        "'load' to the least loaded (tokens of work)")
    p.add_argument("--cuda-graphs", action=argparse.BooleanOptionalAction,
                   default=d(ExecutorConfig.cuda_graphs),
                   help="on CUDA with a compiled model, replay decode steps as CUDA graphs "
                        "(one per padded batch size, captured on first reuse); "
                        "--no-cuda-graphs launches every kernel from the host")
    p.add_argument("--block-size", type=int, default=d(SchedulerConfig.block_size))
    p.add_argument("--priority-range", metavar="LOW:HIGH",
                   default=d(format_priority_range(SchedulerConfig.priority_range)),
                   help="the priorities callers may ask for (lower is served first); the "
                        "default lets a caller make its own work less urgent, never jump "
                        "ahead of others")
    p.add_argument("--speculative", "--speculative-config", default=d(SchedulerConfig.speculative),
                   metavar="ngram:K[:N[:M]] | draft:PATH:K[:int8|int4]",
                   help="speculative decoding: K tokens proposed for each decoding sequence "
                        "and verified in the same forward; outputs are the same as without "
                        "(greedy and seeded alike). ngram: its last N tokens (down to M; "
                        "default 4 and 2) looked up in its prompt and output, what followed "
                        "proposed. draft: a smaller model of the same vocabulary (or the "
                        "model's own folder quantized, e.g. draft:MODEL:4:int4) proposes, "
                        "while at most 4 sequences run. Also vLLM's JSON, e.g. '{\"method\": "
                        "\"ngram\", \"num_speculative_tokens\": 4, \"prompt_lookup_max\": "
                        "4}' or '{\"method\": \"draft_model\", \"model\": PATH, "
                        "\"num_speculative_tokens\": 4, \"disable_by_batch_size\": 4}'")
    p.add_argument("--lora-modules", nargs="+", type=parse_lora_module, metavar="NAME=PATH",
                   default=d(LoraConfig.modules),
                   help="LoRA adapters (PEFT folders: q/k/v/o and gate/up/down projections) "
                        "served beside the model: a request's model NAME runs under that "
                        "adapter; several adapters and the base model share a batch")
    p.add_argument("--max-loras", type=int, default=d(LoraConfig.max_loras),
                   help="LoRA adapters in the executor at once: with more (--lora-modules or "
                        "loaded at run time), each is loaded as its requests are admitted "
                        "and the least recently used idle one evicted")
    p.add_argument("--max-lora-rank", type=int, default=d(LoraConfig.max_lora_rank),
                   help="the highest LoRA rank an adapter may have")
    p.add_argument("--run-ahead-depth", default=d(SchedulerConfig.depth),
                   metavar="{auto,1,2,3}",
                   help="steps planned ahead of the device's results: 1 is synchronous "
                        "batching; auto (default) runs 2, or on a GPU 3 while its steps are "
                        "short (under ~10 ms), where the host's work between two steps would "
                        "not fit in one")
    p.add_argument("--no-overlap", action="store_true", default=d(False),
                   help="synchronous batching (one step in flight), the baseline: "
                        "--run-ahead-depth 1")
    p.add_argument("--listen", default=d(None), metavar="HOST",
                   help="also take clients from other hosts over tcp:// on HOST (an address "
                        "of this machine, or 0.0.0.0); prints the address to connect to and "
                        "the key clients must give (see --listen-key)")
    p.add_argument("--listen-key", default=d(None), metavar="KEY",
                   help="the key remote clients must give (default: $LLM_PIPELINE_KEY, else "
                        "a fresh one, printed). It authenticates, it does not encrypt: on an "
                        "untrusted network, tunnel the ports (ssh, WireGuard)")
    p.add_argument("--stage-key", default=d(None), metavar="KEY",
                   help="with --listen: stages on other hosts that give this key may join "
                        "(run_pipeline stage ...; default: $LLM_PIPELINE_STAGE_KEY, else none "
                        "may). Authenticates, does not encrypt, like --listen-key")


USAGE = """An LLM inference engine: tokenizer, scheduler, executor and detokenizer processes,
continuous batching over a paged KV cache, the scheduler one step ahead of the device.

  run_pipeline                      a short demo on the default model (SmolLM2-135M-Instruct)
  run_pipeline generate --prompt P  answers for prompts (--prompts-file F, --json, --chat)
  run_pipeline serve --port 8000    the OpenAI-compatible HTTP API
  run_pipeline stage engine --connect tcp://HOST:PORT
                                    a stage on this host joins a pipeline on another one
  run_pipeline bench --help         the benchmarks (scripts/bench)

Each command's own options: run_pipeline COMMAND --help."""


def build_parser() -> argparse.ArgumentParser:
    # No abbreviations: with them `generate --n 3` read as an ambiguous --no-overlap/--no-compile.
    parser = argparse.ArgumentParser(prog="run_pipeline", description=USAGE, allow_abbrev=False,
                                     formatter_class=_Help)
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    parser.add_argument("--debug", action="store_true",
                        help="tracebacks and debug logs of every stage (default: one line "
                             "per error)")
    add_global_options(parser, suppress=False)
    sub = parser.add_subparsers(dest="command", metavar="{generate,serve,stage}")
    gen = sub.add_parser("generate", help="answers for prompts, printed as each one finishes",
                         formatter_class=_Help)
    add_global_options(gen, suppress=True)
    gen.add_argument("--prompt", action="append", default=[], help="repeatable")
    gen.add_argument("--prompts-file", help="one prompt per line (empty lines are skipped, "
                                            "and keep their index)")
    gen.add_argument("--chat", action="store_true", help="wrap each prompt as a user message")
    add_sampling_options(gen)
    gen.add_argument("--json", action="store_true",
                     help="one JSON object per prompt, written as each one finishes (index: "
                          "its place among the --prompt values, then the file's lines)")
    gen.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                     help="a progress bar on stderr: prompts done, tok/s, ETA (default: when "
                          "stderr is a terminal)")
    serve = sub.add_parser("serve", help="the OpenAI-compatible API over HTTP",
                           formatter_class=_Help)
    add_global_options(serve, suppress=True)
    add_serve_options(serve)
    stage = sub.add_parser(
        "stage", formatter_class=argparse.HelpFormatter,
        help="run a stage here that joins a pipeline on another host over tcp://",
        description="Join a running pipeline (started with --listen HOST --stage-key KEY) as "
                    "one more engine (a scheduler and its executor: a whole model, routed to "
                    "like --data-parallel-size's), tokenizer or detokenizer worker, or as the "
                    "host of an engine's last pipeline stages (a pipeline started with "
                    "--joined-pipeline-stages N). It serves until that pipeline stops, and "
                    "leaves it if stopped (Ctrl-C, SIGTERM).")
    stage.add_argument("kind", choices=["engine", "tokenizer", "detokenizer", "pipeline"])
    stage.add_argument("--connect", required=True, metavar="tcp://HOST:PORT",
                       help="the pipeline address the launcher printed")
    stage.add_argument("--stage-key", default=None, metavar="KEY",
                       help="the pipeline's --stage-key (default: $LLM_PIPELINE_STAGE_KEY)")
    stage.add_argument("--model", default=None,
                       help="this host's copy of the pipeline's model folder (default: the "
                            "default model, as the pipeline's)")
    stage.add_argument("--listen", default=None, metavar="HOST",
                       help="the address of this host the other stages reach it on (default: "
                            "the one that routes to the pipeline)")
    return parser


def add_serve_options(p: argparse.ArgumentParser) -> None:
    o = ServerOptions  # every default below is its field's
    p.add_argument("--host", default=o.host)
    p.add_argument("--port", type=int, default=o.port, help="0: any free port")
    p.add_argument("--api-key", default=o.api_key,
                   help="every /v1 call then needs 'Authorization: Bearer KEY'")
    p.add_argument("--api-workers", type=int, default=o.api_workers,
                   help="front-end processes sharing the port and the pipeline")
    p.add_argument("--served-model-name", default=PipelineConfig.served_model_name,
                   help="the model id clients use (default: the model folder's name)")
    p.add_argument("--max-body-bytes", default=format_bytes(o.max_body_bytes),
                   help="request body size limit")
    p.add_argument("--rate-limit-rps", type=float, default=o.rate_limit_rps,
                   help="requests per second per API key and per client address (0: off)")
    p.add_argument("--rate-limit-concurrent", type=int, default=o.rate_limit_concurrent,
                   help="requests at once per API key and per client address (0: off)")
    p.add_argument("--max-waiting", type=int, default=o.max_waiting,
                   help="answer 503 while this many sequences wait in each engine's "
                        "scheduler (generate and LLM() queue without a bound)")
    p.add_argument("--access-log", action=argparse.BooleanOptionalAction, default=o.access_log,
                   help="a line on stderr per API request (client, route, status, time)")
    p.add_argument("--stats-interval", type=float, default=o.stats_interval, metavar="S",
                   help="a line on stderr every S seconds: throughput, running/waiting, KV "
                        "cache use, prefix hits, device idle (0: off)")
    p.add_argument("--allowed-origins", default=",".join(o.allowed_origins), metavar="ORIGINS",
                   help="CORS: comma-separated origins that browsers may call the API from, "
                        "or '*' for any (default: none, CORS off)")
    p.add_argument("--tool-call-parser", default=o.tool_call_parser, choices=TOOL_CALL_PARSERS,
                   help="the format the model writes tool calls in (vLLM's names; default: "
                        "Hermes' and Llama 3.1's, after the one the chat template shows)")
    p.add_argument("--reasoning-parser", default=o.reasoning_parser, metavar="NAME",
                   help="split a thinking model's reasoning out of chat answers into "
                        "reasoning_content: qwen3, deepseek_r1 or openai_gptoss (vLLM's "
                        "names)")
    p.add_argument("--enable-lora-updating", action="store_true", default=o.lora_updating,
                   help="serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter: "
                        "adapters loaded at run time share the --max-loras slots that "
                        "--lora-modules leave, swapped in as requests need them (also "
                        "$VLLM_ALLOW_RUNTIME_LORA_UPDATING=1, vLLM's gate; one API worker)")


def add_sampling_options(p: argparse.ArgumentParser) -> None:
    """One flag per SamplingParams field, of the same name with dashes (see its docstring),
    its default GENERATE_SAMPLING's."""
    d, so = GENERATE_SAMPLING, StructuredOutputs()
    g = p.add_argument_group("sampling (per request; see ipc.messages.SamplingParams)")
    g.add_argument("--max-tokens", type=_max_tokens, default=d.max_tokens,
                   help=f"default {d.max_tokens}: an answer's length, and a bound, so a "
                        "raw prompt that never reaches EOS cannot run for minutes; 'none': "
                        "until EOS or the context ends")
    g.add_argument("--min-tokens", type=int, default=d.min_tokens)
    g.add_argument("--temperature", type=float, default=d.temperature,
                   help="0 = greedy (default: %(default)s)")
    g.add_argument("--top-p", type=float, default=d.top_p)
    g.add_argument("--top-k", type=int, default=d.top_k, help="0 or -1: off")
    g.add_argument("--min-p", type=float, default=d.min_p)
    g.add_argument("--seed", type=int, default=d.seed)
    g.add_argument("--repetition-penalty", type=float, default=d.repetition_penalty)
    g.add_argument("--presence-penalty", type=float, default=d.presence_penalty)
    g.add_argument("--frequency-penalty", type=float, default=d.frequency_penalty)
    g.add_argument("--stop", action="append", default=list(d.stop),
                   help="a stop string; repeatable")
    g.add_argument("--stop-token-ids", type=int, nargs="+", default=list(d.stop_token_ids))
    g.add_argument("--ignore-eos", action="store_true")
    g.add_argument("--include-stop-str-in-output", action="store_true")
    g.add_argument("--skip-special-tokens", action=argparse.BooleanOptionalAction,
                   default=d.skip_special_tokens)
    g.add_argument("--n", type=int, default=d.n, help="samples per prompt")
    g.add_argument("--prompt-logprobs", type=int, default=d.prompt_logprobs, metavar="K",
                   help="each prompt token's logprob and K alternatives (0..20), in --json")
    g.add_argument("--logprobs", type=int, default=d.logprobs,
                   help="the sampled token's logprob and this many alternatives (0..20)")
    g.add_argument("--priority", type=int, default=d.priority,
                   help="lower is served first, within --priority-range")
    g.add_argument("--user", default=d.user, help="who the requests are for (fair sharing)")
    g.add_argument("--no-speculate", dest="speculate", action="store_false",
                   help="with --speculative on: these requests take one token a step")
    g.add_argument("--logit-bias", action="append", type=_logit_bias, metavar="ID=BIAS",
                   default=list(d.logit_bias),
                   help="add BIAS (-100..100) to token ID's logit; repeatable")
    g.add_argument("--lora-name", default=d.lora_name, metavar="NAME",
                   help="run the prompts under this adapter of --lora-modules")
    s = p.add_argument_group("structured output (at most one; TEXT or @FILE)")
    s.add_argument("--json-schema", metavar="SCHEMA", default=so.json,
                   help="the output is JSON valid under this JSON Schema")
    s.add_argument("--json-object", action="store_true", help="the output is a JSON object")
    s.add_argument("--regex", default=so.regex,
                   help="the output matches this regular expression")
    s.add_argument("--choice", action="append", default=so.choice,
                   help="the output is one of these strings; repeatable")
    s.add_argument("--grammar", default=so.grammar, help="the output follows this Lark grammar")


def _logit_bias(text: str) -> LogitBias:
    token, _, bias = text.partition("=")
    try:
        return LogitBias(int(token), float(bias))
    except ValueError:
        raise argparse.ArgumentTypeError(f"give ID=BIAS (a token id and a number), not "
                                         f"{text!r}") from None


def _text_or_file(value: str | None, flag: str) -> str | None:
    if value is None or not value.startswith("@"):
        return value
    try:
        return Path(value[1:]).read_text()
    except OSError as exc:
        raise ConfigError(f"{flag}: cannot read {value[1:]}: {exc.strerror}") from None


def structured_outputs(args: argparse.Namespace) -> StructuredOutputs | None:
    so = StructuredOutputs(json=_text_or_file(args.json_schema, "--json-schema"),
                           regex=_text_or_file(args.regex, "--regex"), choice=args.choice,
                           grammar=_text_or_file(args.grammar, "--grammar"),
                           json_object=args.json_object)
    if so.json is not None:
        try:
            json.loads(so.json)
        except ValueError as exc:
            raise ConfigError(f"--json-schema is not valid JSON: {exc}") from None
    kinds = so.kinds()
    if len(kinds) > 1:
        raise ConfigError("give at most one structured output, not --"
                          + " and --".join(k.replace("_", "-") for k in kinds))
    return so if kinds else None


DEFAULT_MAX_TOKENS = 256
# `generate`'s defaults of each request: SamplingParams's (the API's, as vLLM's), but greedy and
# bounded: a prompt on the command line is answered alike every time, and cannot run for
# minutes on a raw prompt that never reaches EOS.
GENERATE_SAMPLING = SamplingParams(max_tokens=DEFAULT_MAX_TOKENS, temperature=0.0)


def _max_tokens(text: str) -> int | None:
    if text.lower() == "none":
        return None
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"give a number of tokens or 'none', not {text!r}")\
            from None


def sampling_params(args: argparse.Namespace) -> SamplingParams:
    # (pooling: an embedding is asked through POST /v1/embeddings or LLM.embed, not here)
    return SamplingParams(**{f.name: getattr(args, f.name)
                             for f in dataclasses.fields(SamplingParams)
                             # (reasoning: set by the server's reasoning parser; lora_path:
                             # by the server, for an adapter loaded at run time)
                             if f.name not in ("structured_outputs", "reasoning", "pooling",
                                               "lora_path")},
                          structured_outputs=structured_outputs(args))


def listen_host(host: str | None) -> str:
    if host is None:
        return ""
    if ":" in host:
        raise ConfigError(f"--listen {host}: give an IPv4 address or a host name (IPv6 is "
                          "not supported for remote clients yet)")
    return host


def format_priority_range(value: tuple[int, int]) -> str:
    return f"{value[0]}:{value[1]}"


def parse_priority_range(text: str) -> tuple[int, int]:
    try:
        lo, hi = (int(x) for x in text.split(":"))
    except ValueError:
        raise ConfigError(f"--priority-range {text!r}: give LOW:HIGH, e.g. 0:10 or -5:5") from None
    return lo, hi


def client_key(given: str | None) -> str:
    """--listen-key, else $LLM_PIPELINE_KEY, else "" (the launcher makes one)."""
    return _key(given, KEY_ENV, "client key (--listen-key")


def stage_key(given: str | None) -> str:
    """--stage-key, else $LLM_PIPELINE_STAGE_KEY, else "" (no stage may join)."""
    from pipeline.runtime.remote import STAGE_KEY_ENV

    return _key(given, STAGE_KEY_ENV, "stage key (--stage-key")


def _key(given: str | None, env: str, what: str) -> str:
    key = given if given is not None else os.environ.get(env, "")
    if key and len(key) < 16:
        raise ConfigError(f"the {what} or ${env}) must be at least 16 characters")
    return key


def run_stage_command(args: argparse.Namespace) -> int:
    """`run_pipeline stage KIND --connect ADDRESS`: join, serve, leave."""
    from pipeline.runtime.remote import STAGE_KEY_ENV, run_joined
    from pipeline.runtime.roster import JoinError

    key = stage_key(args.stage_key)
    if not key:
        raise ConfigError(f"joining needs the pipeline's stage key: --stage-key or "
                          f"${STAGE_KEY_ENV}")
    if not args.connect.startswith("tcp://"):
        raise ConfigError(f"--connect {args.connect}: give the tcp://HOST:PORT the pipeline "
                          "printed")
    from pipeline.tools.model_source import resolve_model

    model = str(ModelInfo.from_dir(resolve_model(args.model)).path)
    try:
        return run_joined(args.connect, args.kind, key, model, listen_host(args.listen) or None)
    except JoinError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1


def build_config(args: argparse.Namespace) -> PipelineConfig:
    """The run's config from the parsed options, each field by name (a flag a command lacks,
    e.g. serve's, keeps the field's default)."""
    from pipeline.tools.model_source import resolve_model

    return PipelineConfig(
        model=ModelInfo.from_dir(resolve_model(args.model), args.max_model_len),
        scheduler=scheduler_config(args), executor=executor_config(args),
        num_tokenizers=args.tokenizer_workers, num_detokenizers=args.detokenizer_workers,
        data_parallel_size=args.data_parallel_size, router=args.router,
        served_model_name=getattr(args, "served_model_name", PipelineConfig.served_model_name),
        remote=RemoteSettings(listen_host=listen_host(args.listen)),
        lora=LoraConfig(modules=tuple(args.lora_modules), max_loras=args.max_loras,
                        max_lora_rank=args.max_lora_rank,
                        # (serve's flag; the env var too, read for serve only)
                        runtime_updating=hasattr(args, "enable_lora_updating")
                        and runtime_updating(args.enable_lora_updating)),
        keys=RunKeys(client_key=client_key(args.listen_key), stage_key=stage_key(args.stage_key)))


def scheduler_config(args: argparse.Namespace) -> SchedulerConfig:
    return SchedulerConfig(
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        block_size=args.block_size, depth=run_ahead_depth(args),
        max_waiting=getattr(args, "max_waiting", SchedulerConfig.max_waiting),
        priority_range=parse_priority_range(args.priority_range),
        speculative=parse_speculative(args.speculative))


def run_ahead_depth(args: argparse.Namespace) -> int | Literal["auto"]:
    depth = parse_depth(args.run_ahead_depth)
    if args.no_overlap and depth != 1:
        if args.run_ahead_depth != SchedulerConfig.depth:  # (given both ways)
            raise ConfigError(f"--no-overlap is --run-ahead-depth 1; it was given with "
                              f"--run-ahead-depth {args.run_ahead_depth}")
        return 1
    return depth


def executor_config(args: argparse.Namespace) -> ExecutorConfig:
    return ExecutorConfig.for_device(
        args.device, dtype=args.dtype, kv_cache_memory=parse_bytes(args.kv_cache_memory),
        compile=args.compile, cuda_graphs=args.cuda_graphs,
        tensor_parallel_size=args.tensor_parallel_size,
        pipeline_parallel_size=args.pipeline_parallel_size,
        pipeline_layer_partition=args.pipeline_layer_partition,
        joined_pipeline_stages=args.joined_pipeline_stages, quantization=args.quantization,
        kv_cache_dtype=args.kv_cache_dtype)


def read_prompts(args: argparse.Namespace) -> list[tuple[int, str]]:
    """(index, prompt) of each prompt to run: the --prompt values, then the file's lines
    (index = their place, an empty line keeping its index but not run)."""
    prompts = list(enumerate(args.prompt))
    if args.prompts_file:
        path = Path(args.prompts_file)
        try:
            text = path.read_text(encoding="utf-8")
        except FileNotFoundError:
            raise ConfigError(f"--prompts-file {path}: no such file") from None
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(f"--prompts-file {path}: cannot read it: {exc}") from None
        first = len(prompts)
        prompts += [(first + i, line) for i, line in enumerate(text.splitlines())
                    if line.strip()]
    if not prompts:
        raise ConfigError("generate needs at least one --prompt or a --prompts-file")
    return prompts


def check_generate(args: argparse.Namespace, vocab_size: int) -> None:
    """Everything `generate` can check before the pipeline starts: the prompts, the
    sampling parameters."""
    read_prompts(args)
    try:
        validate_params(sampling_params(args), vocab_size)
    except RequestError as exc:
        flag = f"--{exc.param.replace('_', '-')}: " if exc.param else ""
        raise ConfigError(f"{flag}{exc.message}") from None


def logprobs_json(logprobs: list[TokenLogprob]) -> list[dict[str, Any]]:
    """A prompt's first token, which nothing scores (NaN), has logprob null."""
    return [{"token_id": lp.token_id, "token": lp.token,
             "logprob": None if math.isnan(lp.logprob) else lp.logprob,
             **({"rank": lp.rank} if lp.rank is not None else {}),
             "top_logprobs": [{"token_id": i, "token": t, "logprob": v} for i, t, v in
                              zip(lp.top_ids, lp.top_tokens, lp.top_logprobs, strict=True)]}
            for lp in logprobs]


def output_json(index: int, out: CompletionOutput, params: SamplingParams,
                prompt: str | None = None) -> str:
    """Sample 0's text, ids and counts at the top (n > 1: every sample's in `samples`, and
    total_output_tokens over them)."""
    line: dict[str, Any] = {
        "index": index, "prompt": prompt, "text": out.text, "token_ids": out.token_ids,
        "finish_reason": out.finish_reason, "stop_reason": out.stop_reason,
        "num_prompt_tokens": out.num_prompt_tokens,
        "num_output_tokens": len(out.samples[0].token_ids),
        "total_output_tokens": out.num_output_tokens,
        "num_cached_prompt_tokens": out.num_cached_tokens, "error": out.error,
    }
    if params.logprobs is not None:
        line["logprobs"] = logprobs_json(out.logprobs)
    if params.prompt_logprobs is not None:
        line["prompt_logprobs"] = logprobs_json(out.prompt_logprobs or [])
    if params.n > 1:
        line["samples"] = [{"text": s.text, "token_ids": s.token_ids,
                            "num_output_tokens": len(s.token_ids),
                            "finish_reason": s.finish_reason, "stop_reason": s.stop_reason,
                            **({"logprobs": logprobs_json(s.logprobs)}
                               if params.logprobs is not None else {})}
                           for s in out.samples]
    return json.dumps(line, ensure_ascii=False)


def run_generate(client: PipelineClient, args: argparse.Namespace) -> int:
    """Every prompt at once; each one's answer is written as it finishes (with --json, a
    line; else a block), a progress bar on stderr. Ctrl-C keeps what finished and says how
    many did not. Exit code 1 if any prompt failed."""
    prompts = read_prompts(args)
    params = sampling_params(args)
    done: list[CompletionOutput] = []
    try:
        asyncio.run(_generate_all(client, args, prompts, params, done))
    except KeyboardInterrupt:
        print(f"interrupted: {len(done)} of {len(prompts)} prompts finished (written above); "
              f"{len(prompts) - len(done)} did not", file=sys.stderr)
        return 130
    failed = sum(1 for o in done if o.error)
    if failed:
        print(f"error: {failed} of {len(prompts)} prompts failed (see their output)",
              file=sys.stderr)
        return 1
    return 0


async def _generate_all(client: PipelineClient, args: argparse.Namespace,
                        prompts: list[tuple[int, str]], params: SamplingParams,
                        done: list[CompletionOutput]) -> None:
    from tqdm import tqdm

    show = args.progress if args.progress is not None else sys.stderr.isatty()
    bar = tqdm(total=len(prompts), unit="prompt", disable=not show, file=sys.stderr,
               dynamic_ncols=True)
    start, tokens = time.monotonic(), 0

    async def one(index: int, text: str) -> None:
        nonlocal tokens
        prompt: Any = [ChatMessage("user", text)] if args.chat else text
        out = CompletionOutput(str(index), max(params.n, 1), arrival_time=time.monotonic())
        async for delta in client.stream(prompt, params):
            out.add(delta)
            tokens += len(delta.token_ids)
        done.append(out)
        _write(index, text, out, params, args.json)
        bar.update(1)
        bar.set_postfix_str(f"{tokens / max(time.monotonic() - start, 1e-9):.1f} tok/s")

    try:
        await asyncio.gather(*(one(i, t) for i, t in prompts))
    finally:
        bar.close()


def _write(index: int, text: str, out: CompletionOutput, params: SamplingParams,
           as_json: bool) -> None:
    if as_json:
        print(output_json(index, out, params, text), flush=True)
        return
    for s in out.samples:
        status = f"error: {out.error}" if out.error else s.finish_reason
        label = f"[{index}]" if params.n == 1 else f"[{index}.{s.index}]"
        print(f"=== {label} {text!r} ({status})\n{s.text}\n", flush=True)


async def _stream_demo(client: PipelineClient, params: SamplingParams) -> list[CompletionOutput]:
    """All prompts run at once; answers are shown in order, the current one live."""
    now = time.monotonic()
    outs = [CompletionOutput(str(i), arrival_time=now) for i in range(len(DEMO_PROMPTS))]
    shown = [0] * len(outs)
    cursor = 0

    def show() -> None:
        nonlocal cursor
        while cursor < len(outs):
            out = outs[cursor]
            if shown[cursor] == 0 and out.text == "" and out.finish_reason is None:
                return
            if shown[cursor] == 0:
                print(f"\n>>> {DEMO_PROMPTS[cursor]}\n", end="")
            print(out.text[shown[cursor]:], end="", flush=True)
            shown[cursor] = max(len(out.text), 1)
            if out.finish_reason is None:
                return
            if out.error:
                print(f"[error: {out.error}]", end="")
            print()
            cursor += 1

    async def one(i: int) -> None:
        messages = [ChatMessage("user", DEMO_PROMPTS[i])]
        async for delta in client.stream(messages, params):
            outs[i].add(delta)
            show()

    await asyncio.gather(*(one(i) for i in range(len(outs))))
    return outs


def run_demo(client: PipelineClient, stage_pids: dict[str, int], startup_s: float) -> int:
    params = SamplingParams(max_tokens=128, temperature=0.0)
    start = time.monotonic()
    outs = asyncio.run(_stream_demo(client, params))
    elapsed = time.monotonic() - start
    num_tokens = sum(o.num_output_tokens for o in outs)
    ttfts = [o.ttft for o in outs if o.ttft is not None]
    mean_ttft_ms = 1000 * sum(ttfts) / len(ttfts) if ttfts else float("nan")
    stages = " ".join(f"{name}(pid {pid})" for name, pid in sorted(stage_pids.items()))
    print(f"\nsummary: requests={len(outs)} output_tokens={num_tokens} "
          f"output_tok_s={num_tokens / elapsed:.1f} mean_ttft_ms={mean_ttft_ms:.0f} "
          f"startup_s={startup_s:.1f} stages: {stages}", flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    from pipeline.runtime.launcher import Pipeline
    from pipeline.runtime.supervisor import StartupError

    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["bench"]:  # `llm-pipeline bench ...` is scripts/bench
        from pipeline.tools.bench import main as bench

        return int(bench(argv[1:]))
    args = build_parser().parse_args(argv)
    if args.debug:
        os.environ["LLM_PIPELINE_LOG_LEVEL"] = "DEBUG"  # every stage inherits it
    logging.basicConfig(level=logging.DEBUG if args.debug else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # runs the finally: stop all
    pipe: Pipeline | None = None
    try:
        if args.command == "stage":
            return run_stage_command(args)
        cfg = build_config(args)
        if args.command == "generate":  # what can be checked is, before anything starts
            check_generate(args, cfg.model.vocab_size)
        if args.command == "serve":  # (its refusals, e.g. runtime LoRA with several workers)
            from pipeline.server.serve import server_options

            server_options(args)
        start = time.monotonic()
        pipe = Pipeline(cfg, trace_path=args.trace)
        with pipe:
            startup_s = time.monotonic() - start
            if pipe.address is not None:
                key = "" if args.listen_key or os.environ.get(KEY_ENV) else (
                    f" key: {pipe.cfg.keys.client_key}")
                print(f"pipeline address: {pipe.address}{key} (PipelineClient.connect(address, "
                      "key=...))", flush=True)
                if pipe.cfg.accepts_stages:
                    print(f"stages on other hosts join with: run_pipeline stage "
                          f"engine|tokenizer|detokenizer --connect {pipe.address}", flush=True)
            client = pipe.client()
            if args.command == "generate":
                return run_generate(client, args)
            if args.command == "serve":
                from pipeline.server.serve import run_serve

                return run_serve(pipe, args)
            return run_demo(client, pipe.stage_pids, startup_s)
    except StartupError as exc:
        print(f"error: the pipeline did not start: {exc}", file=sys.stderr)
        return 1
    except PipelineError as exc:  # a stage of the engine died (the pipeline has stopped)
        failure = pipe.failure if pipe is not None else None
        print(f"error: {failure or exc}", file=sys.stderr)
        return 1
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted: pipeline stopped", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
