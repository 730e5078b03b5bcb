"""Frozen configuration of one pipeline run, and the limits every stage shares. Built by the
launcher's user, completed by the launcher (run directory, run id), handed to every stage.

`EngineLimits` is derived from it in one place (`PipelineConfig.limits`): the sizes that the
scheduler, the executor and the shared rings must agree on. Values found at run time (the
number of KV blocks) come back in ready messages; the config is never mutated. What a config
is built from lives beside it: the model (ipc/model_info.py), --device (ipc/device.py); what
is derived from it too: its addresses (ipc/addresses.py), its endpoints (ipc/endpoints.py).
(The two environment variables are read where they apply: LLM_PIPELINE_CACHE in
ipc/cache.py, LLM_PIPELINE_LOG_LEVEL in each stage's logging set-up.)
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from ipc.addresses import RemoteSettings, RunAddresses
from ipc.device import TIMED_SYNTAX, parse_device
from ipc.endpoints import Endpoints
from ipc.errors import ConfigError
from ipc.lora import LoraConfig, lora_limits
from ipc.model_info import ModelInfo
from ipc.params import DEFAULT_PRIORITY_RANGE, MAX_STOP_TOKEN_IDS
from ipc.ranks import RankLayout
from ipc.speculative import SpeculativeConfig

if TYPE_CHECKING:
    from ipc.curve import CurveKeys


# Every default of a run lives in these dataclasses: the CLI's flags (pipeline/cli.py), LLM()'s
# keywords (pipeline/offline.py), the server's options and the benchmarks read them (e.g.
# `default=SchedulerConfig.max_num_seqs`), so a default is changed here and nowhere else
# (tests/test_defaults.py holds every flag to it). The configs are keyword-only: a new field
# cannot shift the arguments of a caller. (EngineLimits, derived, not yet: tests build it
# positionally.)


# --run-ahead-depth: the most steps in flight a run may choose. Depth d gives the chain from
# the end of step N on the device to the launch of step N + d (the executor's report, the
# scheduler's on_sampled, schedule and write, the executor's prepare and launch) d - 1 device
# steps to run in; a step more also fixes each plan a step earlier and computes one more
# discarded token per finished sequence.
MAX_RUN_AHEAD_DEPTH = 3
# `auto` runs 3 deep while the median of the recent device steps is under this (and 2 above
# 1.25 times it). Measured on a 2-core host (docs/BENCHMARKS.md "How deep"): with a 0.8 ms
# launch, depth 2's chain leaves a device idle under ~1% only from ~3 ms steps at batch 64
# and ~10 ms at batch 256; below 10 ms the pacer plans at once anyway (StepPacer.MIN_STEP_S).
AUTO_DEEP_STEP_MS = 10.0


def parse_depth(text: str | int) -> int | Literal["auto"]:
    """--run-ahead-depth: auto, or 1 (synchronous) to MAX_RUN_AHEAD_DEPTH steps in flight."""
    if text == "auto":
        return "auto"
    try:
        depth = int(text)
    except ValueError:
        depth = 0
    if not 1 <= depth <= MAX_RUN_AHEAD_DEPTH:
        raise ConfigError(f"--run-ahead-depth must be auto or 1 to {MAX_RUN_AHEAD_DEPTH}, "
                          f"got {text!r}")
    return depth


@dataclass(frozen=True, kw_only=True)
class SchedulerConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    block_size: int = 16
    # Steps in flight: 1 = synchronous batching; auto = 2, or 3 while the device's steps are
    # short (stages/scheduler/pacing.py RunAheadDepth).
    depth: int | Literal["auto"] = "auto"
    max_waiting: int | None = None  # sequences that may wait; past it a request is refused
    priority_range: tuple[int, int] = DEFAULT_PRIORITY_RANGE  # (most, least) urgent allowed
    speculative: SpeculativeConfig | None = None  # n-gram drafts verified in the forward

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "block_size"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be at least 1, got {getattr(self, name)}")
        parse_depth(self.depth)
        if self.max_waiting is not None and self.max_waiting < 1:
            raise ConfigError(f"--max-waiting must be at least 1, got {self.max_waiting}")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ConfigError("max_num_batched_tokens must be at least max_num_seqs")
        lo, hi = self.priority_range
        if not -1000 <= lo <= hi <= 1000:
            raise ConfigError(f"--priority-range must be LOW:HIGH with -1000 <= LOW <= HIGH "
                              f"<= 1000, got {lo}:{hi}")


# `serve`'s max_waiting (SchedulerConfig's is None: no bound). A server answers 503 past it, so
# that a load balancer or a client's retry sees an overload at once instead of a queue that
# grows without end; a program's own batch (generate, LLM()) is queued whole, never refused.
# (Also ServerOptions.max_waiting, the front end's admission.)
SERVE_MAX_WAITING = 1024
# The tool-call formats `serve` reads answers for (pipeline/server/tool_parsers.py), vLLM's
# names; None: Hermes and Llama 3.1's JSON, after the one the chat template shows.
TOOL_CALL_PARSERS = ("hermes", "llama3_json", "mistral", "pythonic", "qwen3_coder", "openai")


@dataclass(frozen=True, kw_only=True)
class ServerOptions:
    """`serve`'s HTTP front end (pipeline/server/), beside the engine's settings so that
    every default a user can set is in this file."""

    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    api_workers: int = 1
    max_body_bytes: int = 4 << 20
    rate_limit_rps: float = 0.0  # per API key and per client address; 0: off
    rate_limit_concurrent: int = 0  # requests at once, per key and per address; 0: off
    # Sequences waiting in the scheduler (each engine's) before new requests get 503.
    max_waiting: int = SERVE_MAX_WAITING
    allowed_origins: tuple[str, ...] = ()  # CORS: origins browsers may call from ("*": any)
    access_log: bool = True  # a line per request on stderr
    stats_interval: float = 10.0  # seconds between the engine's stats lines on stderr; 0: off
    tool_call_parser: str | None = None  # one of TOOL_CALL_PARSERS; None: from the template
    # a thinking model's reasoning split out of chat answers (pipeline/server/reasoning.py)
    reasoning_parser: str | None = None
    # POST /v1/load_lora_adapter and /v1/unload_lora_adapter served (--enable-lora-updating,
    # LoraConfig.runtime_updating), and the rank an adapter they load may have
    lora_updating: bool = False
    max_lora_rank: int = 16


# Weight formats made at load from a float checkpoint (stages/executor/linear/quantized.py):
# int8 = 8-bit codes with an fp16 scale and minimum per 32 inputs; int4 = 4-bit codes, a scale
# and a minimum per 32 inputs (Q4_1), the head kept at int8.
QUANTIZATIONS = ("int8", "int4")
# The KV cache's formats (stages/executor/kv_pool.py): the model's dtype, int8 codes with an fp16
# scale per token and KV head, or vLLM's fp8 names (fp8 is fp8_e4m3).
KV_CACHE_DTYPES = ("auto", "int8", "fp8", "fp8_e4m3", "fp8_e5m2")


@dataclass(frozen=True, kw_only=True)
class ExecutorConfig:
    device: str = "cpu"  # a torch device: cpu, cuda, cuda:N
    dtype: str = "float32"
    kv_cache_memory: int = 1 << 30
    num_threads: int | None = None
    # (A, B, S): no model; A + B * tokens ms a step on the device, S ms of host work to launch it
    timed: tuple[float, float, float] | None = None
    compile: bool | None = None  # torch.compile the model; None: the device's default
    cuda_graphs: bool = True  # on CUDA, compiled: replay decode steps as CUDA graphs
    tensor_parallel_size: int = 1  # executor ranks, each holding 1/K of the model
    # Stages of consecutive layers, each of tensor_parallel_size ranks (ipc/ranks.py); the
    # layers each stage holds: even, or these counts (--pipeline-layer-partition)
    pipeline_parallel_size: int = 1
    pipeline_layer_partition: tuple[int, ...] | None = None
    # The last N stages run on a host that joins (run_pipeline stage pipeline): ipc/ranks.py
    joined_pipeline_stages: int = 0
    quantization: str | None = None  # QUANTIZATIONS: weights quantized at load (CPU)
    kv_cache_dtype: str = "auto"  # KV_CACHE_DTYPES: the KV cache's format

    def __post_init__(self) -> None:
        if self.dtype not in ("float32", "bfloat16"):
            raise ConfigError(f"--dtype must be float32 or bfloat16, got {self.dtype!r}")
        if self.quantization is not None and self.quantization not in QUANTIZATIONS:
            raise ConfigError(f"--quantization must be one of {', '.join(QUANTIZATIONS)}, "
                              f"got {self.quantization!r}")
        if self.quantization is not None and self.timed is not None:
            raise ConfigError("--quantization needs a model, not the timed device")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ConfigError(f"--kv-cache-dtype must be one of {', '.join(KV_CACHE_DTYPES)}, "
                              f"got {self.kv_cache_dtype!r}")
        if self.kv_cache_dtype != "auto" and self.timed is not None:
            raise ConfigError("--kv-cache-dtype needs a model, not the timed device")
        if self.device not in ("cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ConfigError(f"--device must be cpu, cuda[:N] or {TIMED_SYNTAX}, "
                              f"got {self.device!r}")
        if self.kv_cache_memory <= 0:
            raise ConfigError("--kv-cache-memory must be positive")
        if self.tensor_parallel_size < 1:
            raise ConfigError("--tensor-parallel-size must be at least 1")
        if self.tensor_parallel_size > 1 and self.timed is not None:
            raise ConfigError("--tensor-parallel-size needs a model, not the timed device")
        if self.pipeline_parallel_size < 1:
            raise ConfigError("--pipeline-parallel-size must be at least 1")
        if not 0 <= self.joined_pipeline_stages < self.pipeline_parallel_size:
            raise ConfigError(f"--joined-pipeline-stages {self.joined_pipeline_stages}: at least "
                              f"0 and below --pipeline-parallel-size "
                              f"{self.pipeline_parallel_size} (the first stage runs here)")
        if self.joined_pipeline_stages and self.timed is not None:
            raise ConfigError("--joined-pipeline-stages needs a model, not the timed device")
        given = self.pipeline_layer_partition
        if given is not None and len(given) != self.pipeline_parallel_size:
            raise ConfigError(f"--pipeline-layer-partition gives {len(given)} stage(s) "
                              f"({','.join(map(str, given))}) for --pipeline-parallel-size "
                              f"{self.pipeline_parallel_size}")

    @classmethod
    def for_device(cls, device: str, **fields: Any) -> ExecutorConfig:
        """From the --device option's text (which may name the timed instrument); the other
        fields by name, their defaults the dataclass's."""
        torch_device, timed = parse_device(device)
        return cls(device=torch_device, timed=timed, **fields)


@dataclass(frozen=True)
class EngineLimits:
    """The sizes the scheduler, the executor and the shared rings agree on, derived once from
    the config (PipelineConfig.limits; the in-process engine builds one directly)."""

    max_num_seqs: int
    max_num_batched_tokens: int
    block_size: int
    max_model_len: int
    vocab_size: int
    eos_token_ids: tuple[int, ...] = ()
    depth: int = 2  # the most steps in flight per micro-batch set (see pipeline_stages)
    priority_range: tuple[int, int] = DEFAULT_PRIORITY_RANGE
    num_speculative_tokens: int = 0  # K: drafts a row may carry (0: no speculation)
    auto_depth: bool = False  # in flight: 2, or `depth` while the device's steps are short
    # The window of each group of layers whose KV blocks are kept apart (ModelInfo.kv_windows):
    # a block table each over one pool, the scheduler giving back a running sequence's
    # blocks of a windowed group as they fall out of its window. (None,): one group, every
    # block kept (no window, or a draft model beside it).
    kv_windows: tuple[int | None, ...] = (None,)
    # P: executor stages the model's layers are split over (pipeline parallelism). Each stage
    # works on a different step at once, so P times `depth` steps may be in flight; the
    # scheduler splits the running sequences into P sets that take turns (step_builder.py).
    pipeline_stages: int = 1
    # The served LoRA adapters (--lora-modules), adapter id i + 1 for entry i (ipc/lora.py)
    lora_names: tuple[str, ...] = ()
    lora_paths: tuple[str, ...] = ()  # their folders, in the same order
    # The executor's adapter slots when adapters are swapped (LoraConfig.swap_slots; 0: the
    # --lora-modules adapters stay loaded), and whether a request may bring an adapter's
    # folder (SamplingParams.lora_path: one loaded at run time)
    lora_slots: int = 0
    lora_updating: bool = False

    def __post_init__(self) -> None:
        windowed = [w for w in self.kv_windows if w is not None]
        if (not self.kv_windows or len(set(windowed)) > 1
                or list(self.kv_windows[len(self.kv_windows) - len(windowed):]) != windowed):
            raise ConfigError(f"kv_windows {self.kv_windows}: the groups that read every key "
                              "first, then those of the one window (ArchSpec.kv_windows)")
        if self.pipeline_stages < 1:
            raise ConfigError(f"pipeline_stages must be at least 1, got {self.pipeline_stages}")

    @property
    def max_inflight(self) -> int:
        """The most steps in flight: `depth` for each of the P stages' micro-batch sets."""
        return self.pipeline_stages * self.depth

    @property
    def max_sampled(self) -> int:
        """Positions one step may sample: one per row, and each draft of a row."""
        return self.max_num_seqs * (1 + self.num_speculative_tokens)

    @property
    def max_blocks_per_seq(self) -> int:
        return -(-self.max_model_len // self.block_size)

    @property
    def max_block_updates(self) -> int:
        """Block-table writes one step may carry: the blocks its tokens can fill, one partial
        block per row on each side, and one whole sequence's table (a prefix-cache hit), in
        each KV group's table."""
        per_step = self.max_num_batched_tokens // self.block_size + 2 * self.max_num_seqs
        return len(self.kv_windows) * (per_step + self.max_blocks_per_seq)

    @property
    def num_ring_slots(self) -> int:
        # A slot is rewritten only after the step that used it reported back.
        return self.max_inflight + 1

    @property
    def max_stop_ids(self) -> int:
        """(slot, id) pairs min_tokens may suppress in one step: each new sequence's
        stop_token_ids (validate_params bounds them) and the EOS ids."""
        return self.max_num_seqs * (MAX_STOP_TOKEN_IDS + len(self.eos_token_ids))


def kept_windows(model: ModelInfo, speculative: SpeculativeConfig | None
                 ) -> tuple[int | None, ...]:
    """The KV groups of a run (EngineLimits.kv_windows): the model's, but one that keeps every
    block beside a draft model, whose own layers may read every key of its KV (it shares the
    target's block ids)."""
    if speculative is not None and speculative.is_draft_model:
        return (None,)
    return model.kv_windows


@dataclass(frozen=True, kw_only=True)
class RunKeys:
    """A run's keys and secrets, apart from its settings: what proves a frame, a client or a
    stage belongs to the run. The operator gives the keys (or the launcher makes the client
    key); the launcher makes the secrets, which are handed to the stages at spawn, never
    written to disk or told to clients."""

    # Prefixes every frame a client sends (requests, aborts) and opens the bootstrap socket:
    # set by the operator for --listen (or made by the launcher), written to the run
    # directory's pipeline.json for local clients; remote clients must be given it. The only
    # one of these a stage joining from another host is sent (PipelineConfig.to_wire).
    client_key: str = ""
    # Stages on other hosts (pipeline/runtime/remote.py) may join a run that has --listen and
    # this key; they prove they hold it, and the run's secret is derived from it
    # (derive_run_secret), so the secret itself never crosses the network in a join.
    stage_key: str = ""
    # Prefixes every frame between stages (ipc/channels.py).
    run_secret: bytes = b""
    # The secret half of the run's CURVE server key (ipc/curve.py), with --listen: made by
    # the launcher (derived from the stage key where stages may join); a joined stage
    # derives it.
    curve_secret: bytes = b""


@dataclass(frozen=True, kw_only=True)
class PipelineConfig(RunAddresses):
    """One run's configuration, handed to every stage. Its socket addresses and ring names
    (cfg.scheduler_address, cfg.step_ring_name, ...) come from RunAddresses (ipc/addresses.py);
    the views over every engine (scheduler_addresses, endpoints) are here, beside for_engine."""

    model: ModelInfo
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    executor: ExecutorConfig = field(default_factory=ExecutorConfig)
    num_tokenizers: int = 1
    num_detokenizers: int = 1
    run_dir: str = ""
    run_id: str = ""
    ready_timeout_s: float = 300.0
    trace_dir: str = ""  # set by the launcher when a trace is asked for
    served_model_name: str = ""  # default: the model folder's name
    # Data parallelism: scheduler+executor pairs ("engines") behind the same tokenizers and
    # detokenizers; `engine` is the one a stage of an engine belongs to (for_engine).
    data_parallel_size: int = 1
    engine: int = 0
    router: str = "prefix"  # how tokenizers pick an engine: "prefix" or "load" (stages/router.py)
    keys: RunKeys = field(default_factory=RunKeys)
    # --listen's host, and in a stage that joined from another host the launcher's status
    # publisher (ipc/addresses.py): what this host is reached on, not a scheduling setting.
    remote: RemoteSettings = field(default_factory=RemoteSettings)
    lora: LoraConfig = field(default_factory=LoraConfig)  # LoRA adapters (ipc/lora.py)

    def for_engine(self, engine: int) -> PipelineConfig:
        """The config a stage of engine `engine` runs with: its addresses and rings."""
        return dataclasses.replace(self, engine=engine)

    @property
    def model_name(self) -> str:
        return self.served_model_name or Path(self.model.path).name

    @property
    def accepts_stages(self) -> bool:
        """Whether stages on other hosts may join (--listen and --stage-key): then every
        stage's inbox from the other stages also listens on tcp://."""
        return bool(self.remote.listen_host and self.keys.stage_key)

    # Fields a joining stage does not get from the launcher: the run's private paths (it has
    # its own run directory), the launcher's host (it listens on its own); of the keys only
    # the client key (the secrets it derives from the stage key it holds).
    _LOCAL_FIELDS = ("run_dir", "trace_dir", "remote")

    def curve_keys(self) -> CurveKeys | None:
        """The CURVE keys of this run's tcp:// side (None without --listen: no tcp://)."""
        from ipc.curve import CurveKeys

        keys = self.keys
        if not (self.remote.listen_host and keys.curve_secret):
            return None
        return CurveKeys.for_stage(keys.curve_secret, keys.client_key, keys.stage_key,
                                   self.run_id)

    def to_wire(self) -> dict[str, object]:
        """This run's config as JSON-able values, for a stage that joins from another host."""
        fields = dataclasses.asdict(self)
        for name in self._LOCAL_FIELDS:
            del fields[name]
        fields["keys"] = {"client_key": self.keys.client_key}
        return fields

    @classmethod
    def from_wire(cls, fields: dict[str, object], model_path: str, keys: RunKeys | None = None,
                  remote: RemoteSettings | None = None) -> PipelineConfig:
        """A joining stage's config: the launcher's (to_wire), its own model folder (which
        must hold the same model: model_fingerprint), its own keys (the launcher's client
        key taken in) and where it is reached."""
        values = dict(fields)
        try:
            told = dict(values.pop("keys"))  # type: ignore[call-overload]
            keys = dataclasses.replace(keys or RunKeys(), client_key=told["client_key"])
            model = dict(values.pop("model"))  # type: ignore[call-overload]
            model["path"] = model_path
            model["eos_token_ids"] = tuple(model["eos_token_ids"])
            model["kv_windows"] = tuple(model["kv_windows"])
            sched = dict(values.pop("scheduler"))  # type: ignore[call-overload]
            sched["priority_range"] = tuple(sched["priority_range"])
            if sched.get("speculative") is not None:
                sched["speculative"] = SpeculativeConfig(**sched["speculative"])
            execu = dict(values.pop("executor"))  # type: ignore[call-overload]
            for name in ("timed", "pipeline_layer_partition"):  # (tuples, sent as lists)
                if execu.get(name) is not None:
                    execu[name] = tuple(execu[name])
            lora = dict(values.pop("lora", {}))  # type: ignore[call-overload]
            lora["modules"] = tuple(tuple(m) for m in lora.get("modules", ()))
            return cls(model=ModelInfo(**model), scheduler=SchedulerConfig(**sched),
                       executor=ExecutorConfig(**execu), keys=keys, lora=LoraConfig(**lora),
                       remote=remote or RemoteSettings(), **values)  # type: ignore[arg-type]
        except (KeyError, TypeError, ValueError) as exc:
            raise ConfigError(f"the launcher sent a config this version cannot read: {exc}"
                              ) from None

    @property
    def endpoints(self) -> Endpoints:
        """The local (ipc://) endpoints of this run."""
        return Endpoints(self.model_name, self.model.max_model_len,
                         tuple(self.tokenizer_address(r) for r in range(self.num_tokenizers)),
                         tuple(self.for_engine(e).abort_address
                               for e in range(self.data_parallel_size)),
                         self.status_address, self.client_reply_prefix, self.keys.client_key,
                         server_key=self._server_key(), lora_names=self.lora.names)

    def _server_key(self) -> str:
        """The public half of the run's CURVE server key ("" without --listen): a client
        dials tcp:// stages with it (a remote one always; a local one an engine that joined
        from another host)."""
        import zmq

        secret = self.keys.curve_secret
        return zmq.curve_public(secret).decode() if secret else ""

    def __post_init__(self) -> None:
        if self.num_tokenizers < 1 or self.num_detokenizers < 1:
            raise ConfigError("there must be at least one tokenizer and one detokenizer worker")
        if self.data_parallel_size < 1:
            raise ConfigError("--data-parallel-size must be at least 1")
        if self.router not in ("prefix", "load"):
            raise ConfigError(f"--router must be prefix or load, got {self.router!r}")
        if self.executor.joined_pipeline_stages and not self.accepts_stages:
            raise ConfigError("--joined-pipeline-stages: those stages join from another host, "
                              "so the pipeline needs --listen HOST and --stage-key KEY")
        if self.executor.joined_pipeline_stages and self.remote.listen_host in ("0.0.0.0", "*"):
            raise ConfigError("--joined-pipeline-stages: the ranks of both hosts connect to each "
                              "other at the --listen address, so give this host's address "
                              f"there, not {self.remote.listen_host}")

    @property
    def limits(self) -> EngineLimits:
        s, m = self.scheduler, self.model
        return EngineLimits(
            max_num_seqs=s.max_num_seqs, max_num_batched_tokens=s.max_num_batched_tokens,
            block_size=s.block_size, max_model_len=m.max_model_len, vocab_size=m.vocab_size,
            eos_token_ids=m.eos_token_ids,
            depth=MAX_RUN_AHEAD_DEPTH if s.depth == "auto" else s.depth,
            priority_range=s.priority_range,
            num_speculative_tokens=s.speculative.num_tokens if s.speculative is not None else 0,
            auto_depth=s.depth == "auto", kv_windows=kept_windows(m, s.speculative),
            pipeline_stages=self.executor.pipeline_parallel_size, **lora_limits(self.lora))

    @property
    def embedding_refusal(self) -> str | None:
        """Why this run refuses embeddings (pooling requests), if it does: the pooled hidden
        states are kept by a single executor rank's model path only."""
        ex = self.executor
        if ex.timed is not None:
            return "embeddings need a model: the timed device computes no hidden states"
        if ex.tensor_parallel_size > 1 or ex.pipeline_parallel_size > 1:
            return ("embeddings are not served with --tensor-parallel-size or "
                    "--pipeline-parallel-size above 1 (one executor rank pools them)")
        return None

    @property
    def ranks(self) -> RankLayout:
        """Which global executor ranks each engine of this run owns."""
        ex = self.executor
        return RankLayout(self.data_parallel_size, ex.tensor_parallel_size,
                          ex.pipeline_parallel_size, ex.joined_pipeline_stages)

    def scheduler_addresses(self) -> list[str]:
        """Every engine's scheduler inbox (what the tokenizers route to, in engine order)."""
        return [self.for_engine(e).scheduler_address for e in range(self.data_parallel_size)]
