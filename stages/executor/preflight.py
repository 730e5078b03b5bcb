"""What the launcher checks of an executor's configuration before anything starts, in the
launcher's process (the user's): the forward that will run (backends/select.py, without
probing), the shapes tensor parallelism must split and the devices its ranks take. Imports
no torch unless the device is CUDA."""

from __future__ import annotations

from pathlib import Path

from ipc.arch import ArchSpec, UnsupportedModel, read_config
from ipc.config import PipelineConfig
from ipc.errors import ConfigError
from stages.executor.backends.select import ForwardRequest, Selection, select_backend


def check_executor(cfg: PipelineConfig) -> Selection | None:
    """The forward the run's executors will choose, or the ConfigError (or UnsupportedModel)
    that one would fail with; None for the timed instrument (no model)."""
    ex = cfg.executor
    if ex.timed is not None:
        return None
    selection = select_backend(ForwardRequest(
        ex.device.split(":")[0], ex.compile, None, cfg.model.sliding_window,
        cfg.limits.block_size, ex.tensor_parallel_size), probe=False)
    if ex.quantization is not None:
        check_quantization(ex.quantization, ex.device, selection.compiled)
    if ex.tensor_parallel_size > 1:
        check_divisible(read_config(cfg.model.path)[1], ex.tensor_parallel_size)
    if ex.tensor_parallel_size * cfg.data_parallel_size > 1:
        check_devices(ex.device, ex.tensor_parallel_size * cfg.data_parallel_size)
    return selection


def check_quantization(name: str, device: str, compiled: bool) -> None:
    """What linear/select.py would refuse, said before anything starts: quantized weights run
    in the eager CPU forward, on a CPU with AVX512-VNNI (the kernels' integer dot products)."""
    if not device.startswith("cpu"):
        raise ConfigError(f"--quantization {name}: quantized weights run on the CPU only, not "
                          f"{device}; leave out --quantization there")
    if compiled:
        raise ConfigError(f"--quantization {name}: it runs in the eager forward; leave out "
                          "--compile")
    flags = cpu_flags()
    if flags is not None and not {"avx512f", "avx512bw", "avx512_vnni"} <= flags:
        raise ConfigError(f"--quantization {name}: this CPU lacks AVX-512 with VNNI, which the "
                          "quantized kernels need; run it in float32 or --dtype bfloat16")


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
    """The shapes K ranks can split evenly, or UnsupportedModel naming the one they cannot."""
    for name, value in (("num_attention_heads", spec.num_heads),
                        ("num_key_value_heads", spec.num_kv_heads),
                        ("intermediate_size", spec.intermediate)):
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
