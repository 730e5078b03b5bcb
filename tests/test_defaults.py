"""Every default a user can set lives once, in the config dataclasses (ipc/config.py): each
flag of run_pipeline (its commands' too), LLM()'s keywords and the benchmarks' engine options
read it there. A flag with no config field is named below with why, so that a new flag cannot
slip by; and the flags are held to the dataclasses both ways: equal today, and following them
when a field's default changes (a flag that hard-codes 64 fails that)."""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from ipc.addresses import RemoteSettings
from ipc.config import (
    SERVE_MAX_WAITING,
    ExecutorConfig,
    PipelineConfig,
    RunKeys,
    SchedulerConfig,
    ServerOptions,
    parse_depth,
)
from ipc.lora import LoraConfig
from ipc.messages import SamplingParams, StructuredOutputs
from ipc.units import parse_bytes
from pipeline.cli import (
    GENERATE_SAMPLING,
    build_config,
    build_parser,
    parse_priority_range,
    sampling_params,
)

ROOT = Path(__file__).resolve().parents[1]


def _same(value: Any) -> Any:
    return value


def _origins(text: str) -> tuple[str, ...]:
    return tuple(o for o in text.split(",") if o)


# A flag's dest -> (the dataclass, its field, how the config reads the flag's value).
FLAG_FIELDS: dict[str, tuple[type, str, Callable[[Any], Any]]] = {
    "dtype": (ExecutorConfig, "dtype", _same),
    "quantization": (ExecutorConfig, "quantization", _same),
    "kv_cache_dtype": (ExecutorConfig, "kv_cache_dtype", _same),
    "device": (ExecutorConfig, "device", _same),
    "kv_cache_memory": (ExecutorConfig, "kv_cache_memory", parse_bytes),
    "compile": (ExecutorConfig, "compile", _same),
    "cuda_graphs": (ExecutorConfig, "cuda_graphs", _same),
    "tensor_parallel_size": (ExecutorConfig, "tensor_parallel_size", _same),
    "pipeline_parallel_size": (ExecutorConfig, "pipeline_parallel_size", _same),
    "pipeline_layer_partition": (ExecutorConfig, "pipeline_layer_partition", _same),
    "joined_pipeline_stages": (ExecutorConfig, "joined_pipeline_stages", _same),
    "max_num_seqs": (SchedulerConfig, "max_num_seqs", _same),
    "max_num_batched_tokens": (SchedulerConfig, "max_num_batched_tokens", _same),
    "block_size": (SchedulerConfig, "block_size", _same),
    "run_ahead_depth": (SchedulerConfig, "depth", parse_depth),
    "priority_range": (SchedulerConfig, "priority_range", parse_priority_range),
    "speculative": (SchedulerConfig, "speculative", _same),
    "tokenizer_workers": (PipelineConfig, "num_tokenizers", _same),
    "detokenizer_workers": (PipelineConfig, "num_detokenizers", _same),
    "data_parallel_size": (PipelineConfig, "data_parallel_size", _same),
    "router": (PipelineConfig, "router", _same),
    "served_model_name": (PipelineConfig, "served_model_name", _same),
    "lora_modules": (LoraConfig, "modules", tuple),
    "max_loras": (LoraConfig, "max_loras", _same),
    "max_lora_rank": (LoraConfig, "max_lora_rank", _same),
    "enable_lora_updating": (ServerOptions, "lora_updating", _same),
    # serve's: the front end's options (its --max-waiting is the scheduler's too)
    "host": (ServerOptions, "host", _same),
    "port": (ServerOptions, "port", _same),
    "api_key": (ServerOptions, "api_key", _same),
    "api_workers": (ServerOptions, "api_workers", _same),
    "max_body_bytes": (ServerOptions, "max_body_bytes", parse_bytes),
    "rate_limit_rps": (ServerOptions, "rate_limit_rps", _same),
    "rate_limit_concurrent": (ServerOptions, "rate_limit_concurrent", _same),
    "max_waiting": (ServerOptions, "max_waiting", _same),
    "access_log": (ServerOptions, "access_log", _same),
    "stats_interval": (ServerOptions, "stats_interval", _same),
    "allowed_origins": (ServerOptions, "allowed_origins", _origins),
    "tool_call_parser": (ServerOptions, "tool_call_parser", _same),
    "reasoning_parser": (ServerOptions, "reasoning_parser", _same),
}

# Flags of no config field, and why. (`None` = not given: what the config then holds is
# checked by test_the_default_flags_build_the_default_configs.)
NOT_CONFIG = {
    "help": "argparse's",
    "version": "argparse's",
    "command": "the command chosen",
    "debug": "this process's logging and the stages' log level, not the run's config",
    "model": "None: the default model (resolve_model), else a folder or a GGUF file",
    "max_model_len": "None: the model's own context length (ModelInfo.from_dir)",
    "trace": "a file this process writes; the launcher sets trace_dir from it",
    "no_overlap": "a switch to depth 1 (--run-ahead-depth 1); unset, SchedulerConfig.depth",
    "listen": "None: no tcp:// (RemoteSettings.listen_host)",
    "listen_key": "None: $LLM_PIPELINE_KEY, else RunKeys.client_key",
    "stage_key": "None: $LLM_PIPELINE_STAGE_KEY, else RunKeys.stage_key",
    "prompt": "generate's input", "prompts_file": "generate's input",
    "chat": "generate's input", "json": "generate's output", "progress": "generate's output",
    "kind": "stage's", "connect": "stage's",
}

# generate's per-request flags: SamplingParams's fields (GENERATE_SAMPLING's defaults) and
# the structured output's (StructuredOutputs', --json-schema being its `json`).
SAMPLING = {f.name: f.name for f in dataclasses.fields(SamplingParams)
            # (reasoning: the server's; pooling: an embedding request's, not generate's;
            # lora_path: an adapter loaded at run time, the server's)
            if f.name not in ("structured_outputs", "reasoning", "pooling", "lora_path")}
STRUCTURED = {"json_schema": "json", "json_object": "json_object", "regex": "regex",
              "choice": "choice", "grammar": "grammar"}


def parsers() -> Iterator[tuple[str, argparse.ArgumentParser]]:
    root = build_parser()
    yield "run_pipeline", root
    for action in root._actions:
        if isinstance(action, argparse._SubParsersAction):
            yield from action.choices.items()


def flags() -> Iterator[tuple[str, argparse.Action]]:
    """(command, action) of every flag whose default the command sets (the commands'
    copies of the global options inherit the top parser's)."""
    for command, parser in parsers():
        for action in parser._actions:
            if action.default is not argparse.SUPPRESS:
                yield command, action


def field_default(cls: type, name: str) -> Any:
    (f,) = (f for f in dataclasses.fields(cls) if f.name == name)
    return f.default_factory() if f.default is dataclasses.MISSING else f.default


def test_every_flag_is_a_config_field_or_named_as_not_one() -> None:
    known = set(FLAG_FIELDS) | set(NOT_CONFIG) | set(SAMPLING) | set(STRUCTURED)
    unknown = sorted({f"{command} --{a.dest}" for command, a in flags() if a.dest not in known})
    assert not unknown, (f"flags of no known field: {unknown}; map each to its dataclass field "
                         "in FLAG_FIELDS (its default read from it), or name it in NOT_CONFIG")
    seen = {a.dest for _, a in flags()}
    assert set(FLAG_FIELDS) <= seen, "a mapped flag is gone: drop it from FLAG_FIELDS"


def test_each_flag_default_is_its_field_default() -> None:
    for command, action in flags():
        if action.dest in FLAG_FIELDS:
            cls, name, read = FLAG_FIELDS[action.dest]
            assert read(action.default) == field_default(cls, name), (command, action.dest)
        elif action.dest in SAMPLING:
            assert action.default == getattr(GENERATE_SAMPLING, action.dest), action.dest
        elif action.dest in STRUCTURED:
            expected = getattr(StructuredOutputs(), STRUCTURED[action.dest])
            assert action.default == expected, action.dest


def _other(value: Any, name: str) -> Any:
    """A default unlike `value`, of its kind (None: a value the field could hold)."""
    if isinstance(value, bool):
        return not value
    if name == "depth":  # (auto, or a depth up to MAX_RUN_AHEAD_DEPTH)
        return 3 if value == "auto" else "auto"
    if isinstance(value, (int, float)):
        return value + 7
    if isinstance(value, str):
        return value + "-other"
    if isinstance(value, tuple):
        return (value[0] + 1, value[1] - 1) if name == "priority_range" else ("http://a.b",)
    return {"quantization": "int8", "compile": True, "api_key": "some-key"}.get(name)


def test_the_flags_follow_the_dataclasses(monkeypatch: pytest.MonkeyPatch) -> None:
    """Change every field's default and build the parser again: each flag says the new one
    (a flag with its own literal does not)."""
    changed = {}
    for dest, (cls, name, _) in FLAG_FIELDS.items():
        other = _other(field_default(cls, name), name)
        if other is not None:  # (speculative: None either way; a flag gives text)
            monkeypatch.setattr(cls, name, other)
            changed[dest] = other
    for command, action in flags():
        if action.dest in changed:
            read = FLAG_FIELDS[action.dest][2]
            assert read(action.default) == changed[action.dest], (command, action.dest)


def test_the_sampling_flags_follow_generate_sampling(monkeypatch: pytest.MonkeyPatch) -> None:
    import pipeline.cli as cli

    other = SamplingParams(max_tokens=9, temperature=0.5, top_p=0.9, top_k=3, min_p=0.1,
                           seed=4, repetition_penalty=1.1, presence_penalty=0.2,
                           frequency_penalty=0.3, n=2, logprobs=1, prompt_logprobs=2,
                           priority=3, user="u", min_tokens=1, stop=["s"], stop_token_ids=[5],
                           skip_special_tokens=False)
    monkeypatch.setattr(cli, "GENERATE_SAMPLING", other)
    switches = (argparse._StoreTrueAction, argparse._StoreFalseAction)  # fixed by the action
    followed = [a.dest for c, a in flags() if c == "generate" and a.dest in SAMPLING
                and not isinstance(a, switches)]
    for command, action in flags():
        if command == "generate" and action.dest in followed:
            assert action.default == getattr(other, action.dest), action.dest
    assert len(followed) == len(SAMPLING) - 3  # all but ignore_eos, include_stop_..., speculate


@pytest.fixture
def no_key_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("LLM_PIPELINE_KEY", raising=False)
    monkeypatch.delenv("LLM_PIPELINE_STAGE_KEY", raising=False)


def test_the_default_flags_build_the_default_configs(tiny_model_dir: Path,
                                                     no_key_env: None) -> None:
    from pipeline.server.serve import server_options

    model = ["--model", str(tiny_model_dir)]
    for command in ([], ["generate", "--prompt", "x"], ["serve"]):
        args = build_parser().parse_args(model + command)
        cfg = build_config(args)
        serve = command == ["serve"]
        expected = SchedulerConfig(max_waiting=SERVE_MAX_WAITING) if serve else SchedulerConfig()
        assert cfg.scheduler == expected and cfg.executor == ExecutorConfig()
        assert cfg.keys == RunKeys() and cfg.remote == RemoteSettings()
        rest = dataclasses.replace(cfg, scheduler=SchedulerConfig())  # (checked above)
        assert rest == PipelineConfig(model=cfg.model), command
    assert server_options(args) == ServerOptions()


def test_generate_differs_from_the_api_only_in_length_and_greed() -> None:
    args = build_parser().parse_args(["generate", "--prompt", "x"])
    assert sampling_params(args) == GENERATE_SAMPLING
    differ = {f.name for f in dataclasses.fields(SamplingParams)
              if getattr(GENERATE_SAMPLING, f.name) != getattr(SamplingParams(), f.name)}
    assert differ == {"max_tokens", "temperature"}


def test_serve_bounds_the_queue_and_the_others_do_not() -> None:
    assert SchedulerConfig().max_waiting is None
    assert ServerOptions().max_waiting == SERVE_MAX_WAITING


# LLM()'s keywords: the CLI flag of the same name's field; `model`, `max_model_len` and
# `speculative` are None (the default model, its own length, off), as the flags'.
LLM_NOT_CONFIG = {"self", "model", "max_model_len", "speculative"}


def test_llm_keywords_read_the_fields() -> None:
    from pipeline.offline import LLM

    params = inspect.signature(LLM).parameters
    for name, param in params.items():
        if name in LLM_NOT_CONFIG:
            assert param.default is None, name
            continue
        cls, field, _ = FLAG_FIELDS[name]
        assert param.default == field_default(cls, field), name
    # ... by name, not as a literal that equals it today:
    tree = ast.parse((ROOT / "pipeline/offline.py").read_text())
    (init,) = (n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)
               and n.name == "__init__")
    args = init.args.kwonlyargs
    for arg, default in zip(args, init.args.kw_defaults, strict=True):
        if arg.arg in LLM_NOT_CONFIG:
            continue
        cls, field, _ = FLAG_FIELDS[arg.arg]
        assert ast.unparse(default) == f"{cls.__name__}.{field}", arg.arg


# The benchmarks' engine options: the dataclass's default, or their own workload's, named.
BENCH_OWN = {
    ("overlap", "max_model_len"), ("serve", "max_model_len"), ("dp", "max_model_len"),
    ("serve", "kv_cache_memory"),  # 2 GiB: a longer workload
    ("dp", "kv_cache_memory"), ("quality", "kv_cache_memory"),  # smaller: several engines, or
    # a short scoring run
    ("dp", "data_parallel_size"),  # 2: the comparison it is for
    ("fairness", "device"), ("overload", "device"),  # the timed device: no model needed
    ("overload", "max_waiting"),  # below serve's, so refusals start sooner
    ("quality", "quantization"), ("quality", "kv_cache_dtype"),  # the formats it compares
    ("throughput", "quantization"), ("throughput", "kv_cache_dtype"),  # lists of formats to
    # run again with
    ("throughput", "max_num_seqs"),  # the batch size unless given: an engine built for more
}


def test_the_benchmarks_engine_options_read_the_fields() -> None:
    from pipeline.tools.bench import build_parser as bench_parser

    (sub,) = (a for a in bench_parser()._actions
              if isinstance(a, argparse._SubParsersAction))
    checked = 0
    for command, parser in sub.choices.items():
        for action in parser._actions:
            dest = action.dest
            if dest not in FLAG_FIELDS or (command, dest) in BENCH_OWN:
                continue
            cls, name, read = FLAG_FIELDS[dest]
            assert read(action.default) == field_default(cls, name), (command, dest)
            checked += 1
    assert checked >= 10
