"""What the launcher checks of an executor's configuration before anything starts, in the
launcher's process (the user's): the forward that will run (backends/select.py, without
probing), the shapes tensor parallelism must split and the devices its ranks take. Imports
no torch unless the device is CUDA."""

from __future__ import annotations

from pathlib import Path

from ipc.addresses import interface_of
from ipc.arch import ArchSpec, UnsupportedModel
from ipc.config import PipelineConfig
from ipc.errors import ConfigError
from ipc.families import read_config
from ipc.gguf_source import GgufSource, gguf_source
from ipc.ranks import partition_layers
from ipc.speculative import SpeculativeConfig
from stages.executor.backends.select import ForwardRequest, Selection, select_backend


def check_executor(cfg: PipelineConfig) -> Selection | None:
    """The forward the run's executors will choose, or the ConfigError (or UnsupportedModel)
    that one would fail with; None for the timed instrument (no model)."""
    ex = cfg.executor
    draft = cfg.scheduler.speculative
    if draft is not None and not draft.is_draft_model:
        draft = None
    if cfg.lora.enabled:
        check_lora(cfg)
    if ex.timed is not None:
        if draft is not None:
            raise ConfigError("a draft model (--speculative draft:...) needs a model, not the "
                              "timed device")
        return None
    selection = select_backend(ForwardRequest(
        ex.device.split(":")[0], ex.compile, None, cfg.limits.block_size,
        ex.tensor_parallel_size, cfg.model.mixture_of_experts, ex.kv_cache_dtype), probe=False)
    gguf = gguf_source(cfg.model.path)
    if gguf is not None and gguf.quantized:
        check_gguf(gguf, ex.quantization, ex.device, selection.compiled,
                   ex.tensor_parallel_size)
    elif ex.quantization is not None:
        check_quantization(ex.quantization, ex.device, selection.compiled)
    if ex.tensor_parallel_size > 1:
        check_divisible(read_config(cfg.model.path)[1], ex.tensor_parallel_size)
    if ex.pipeline_parallel_size > 1:
        check_pipeline(cfg)
    if ex.joined_pipeline_stages:  # (the ranks listen there, across hosts)
        try:
            interface_of(cfg.remote.listen_host)
        except ValueError as exc:
            raise ConfigError(f"--joined-pipeline-stages: {exc}") from None
    num_ranks = cfg.ranks.num_local_ranks  # (a pipeline host brings its own GPUs)
    if num_ranks > 1:
        check_devices(ex.device, num_ranks)
    if draft is not None:
        check_draft(draft, cfg.model.vocab_size, selection, ex.tensor_parallel_size, ex.device)
    return selection


def check_lora(cfg: PipelineConfig) -> None:
    """LoRA adapters (stages/executor/lora.py) run in the CPU's eager forward of one rank of a
    dense model in float weights, without speculative decoding; each adapter folder is
    checked (ipc/lora.py). Everything else is refused here, by name."""
    ex = cfg.executor
    flag = "--lora-modules" if cfg.lora.modules else "--enable-lora-updating"
    refusals = [
        (ex.timed is not None, "the timed device runs no model"),
        (ex.device != "cpu", f"--device {ex.device}: adapters run on the CPU only (the "
                             "segmented products are not written for CUDA or its graphs)"),
        (ex.compile is True, "--compile: the adapters' rows vary step to step; they run in "
                             "the eager forward"),
        (ex.tensor_parallel_size > 1, "--tensor-parallel-size: adapters are not sharded"),
        (ex.pipeline_parallel_size > 1, "--pipeline-parallel-size: adapters are not split "
                                        "into stages"),
        (ex.quantization is not None, f"--quantization {ex.quantization}: adapters run over "
                                      "float weights only"),
        (cfg.scheduler.speculative is not None, "--speculative: a draft's rows would need "
                                                "their adapter too; not implemented"),
        (cfg.model.mixture_of_experts, "a mixture of experts (adapters of experts are not "
                                       "implemented)"),
    ]
    for refused, why in refusals:
        if refused:
            raise ConfigError(f"{flag}: {why}")
    gguf = gguf_source(cfg.model.path)
    if gguf is not None and gguf.quantized:
        raise ConfigError(f"{flag}: {gguf.describe()} is quantized; adapters run over float "
                          "weights only")
    cfg.lora.adapters(read_config(cfg.model.path)[1].num_layers)


def check_pipeline(cfg: PipelineConfig) -> None:
    """Pipeline stages the model can be split into (each at least a layer, the partition
    summing to its layers), and nothing the stages do not run: speculative decoding (its
    drafts and verification run on one rank)."""
    ex = cfg.executor
    spec = read_config(cfg.model.path)[1]
    try:
        partition_layers(spec.num_layers, ex.pipeline_parallel_size, ex.pipeline_layer_partition)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    if cfg.scheduler.speculative is not None:
        raise ConfigError(f"--speculative {cfg.scheduler.speculative.describe()}: speculative "
                          "decoding runs on one pipeline stage; leave out "
                          "--pipeline-parallel-size or --speculative")


def check_draft(draft: SpeculativeConfig, vocab_size: int, target: Selection,
                tensor_parallel_size: int, device: str) -> ArchSpec:
    """A draft model the executor can run beside the model, or ConfigError saying why not:
    its folder (config.json, the same vocabulary), one rank, the CPU kernels' forward (the
    draft passes build their metadata on the device from positions alone, which only that
    forward takes), its quantization where the CPU has the instructions. Its spec."""
    assert draft.model is not None
    subject = f"--speculative {draft.describe()}"
    if tensor_parallel_size > 1:
        raise ConfigError(f"{subject}: a draft model runs on one rank; leave out "
                          "--tensor-parallel-size or use --speculative ngram:K")
    if target.backend != "cpu_kernels":
        raise ConfigError(f"{subject}: a draft model runs beside the CPU kernels' forward only, "
                          f"and this run's is {target.backend} ({target.reason}); use "
                          "--speculative ngram:K there")
    if not (Path(draft.model) / "config.json").is_file():
        raise ConfigError(f"{subject}: {draft.model} is not a model folder (no config.json)")
    spec = read_config(draft.model)[1]
    if spec.vocab_size != vocab_size:
        raise ConfigError(f"{subject}: the draft model's vocabulary has {spec.vocab_size} "
                          f"tokens, the model's {vocab_size}; a draft model must share the "
                          "model's tokenizer")
    if draft.quantization is not None:
        check_quantization(draft.quantization, device, False)
    return spec


def check_quantization(name: str, device: str, compiled: bool) -> None:
    """What linear/select.py would refuse, said before anything starts: quantized weights run
    in the eager CPU forward, on a CPU with AVX512-VNNI (the kernels' integer dot products)."""
    _check_quantized(f"--quantization {name}", device, compiled,
                     "leave out --quantization there", "run it in float32 or --dtype bfloat16")


def check_gguf(gguf: GgufSource, quantization: str | None, device: str, compiled: bool,
               tensor_parallel_size: int) -> None:
    """The same for a quantized GGUF file's blocks, which also run on one rank and are not
    quantized again."""
    subject = gguf.describe()
    if quantization is not None:
        raise ConfigError(f"{subject}: the file is quantized already; leave out "
                          f"--quantization {quantization}")
    if tensor_parallel_size > 1:
        raise ConfigError(f"{subject}: a quantized GGUF file runs on one rank; leave out "
                          "--tensor-parallel-size")
    _check_quantized(subject, device, compiled, "run it with --device cpu",
                     "load an F32 or BF16 GGUF, or the Hugging Face folder, instead")


def _check_quantized(subject: str, device: str, compiled: bool, on_cuda: str,
                     without_vnni: str) -> None:
    if not device.startswith("cpu"):
        raise ConfigError(f"{subject}: quantized weights run on the CPU only, not {device}; "
                          f"{on_cuda}")
    if compiled:
        raise ConfigError(f"{subject}: quantized weights run in the eager forward; leave out "
                          "--compile")
    flags = cpu_flags()
    if flags is not None and not {"avx512f", "avx512bw", "avx512_vnni"} <= flags:
        raise ConfigError(f"{subject}: this CPU lacks AVX-512 with VNNI, which the quantized "
                          f"kernels need; {without_vnni}")


def cpu_flags() -> set[str] | None:
    """The CPU's feature flags from /proc/cpuinfo (None where there is no such file)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.partition(":")[2].split())
    return None


def check_divisible(spec: ArchSpec, size: int, source: str = "config.json") -> None:
    """The shapes K ranks can split evenly, or UnsupportedModel naming the one they cannot:
    the heads, the dense MLPs' intermediate (where a layer has one), each expert's and the
    shared expert's (moe_block.py slices every expert across the ranks). (The q/k norms over
    the whole projections split as the heads do: blocks.Attention sums their squares across
    the ranks.)"""
    moe = spec.moe
    shapes = [("num_attention_heads", spec.num_heads),
              ("num_key_value_heads", spec.num_kv_heads)]
    if not all(spec.sparse(i) for i in range(spec.num_layers)):
        shapes.append(("intermediate_size", spec.intermediate))
    if moe is not None:
        shapes.append((moe.intermediate_key, moe.intermediate))
        if moe.shared_intermediate:
            shapes.append(("shared_expert_intermediate_size", moe.shared_intermediate))
    for name, value in shapes:
        if value % size:
            raise UnsupportedModel(f"{source}: {name} = {value} is not divisible by "
                                   f"--tensor-parallel-size {size}")


def check_devices(device: str, size: int) -> None:
    """On CUDA the executors (tensor-parallel ranks × data-parallel engines) take cuda:0 to
    cuda:N-1, one each: the machine must have them."""
    if not device.startswith("cuda"):
        return
    import torch

    what = ("--tensor-parallel-size × --data-parallel-size = "
            f"{size} executor processes")
    if device not in ("cuda", "cuda:0"):  # (--device cuda reads as cuda:0)
        raise ConfigError(f"--device {device} with {what}: they take cuda:0 to "
                          f"cuda:{size - 1}, one each; pass --device cuda")
    if torch.cuda.device_count() < size:
        raise ConfigError(f"{what} need {size} CUDA devices, one each; this machine has "
                          f"{torch.cuda.device_count()}")
