"""The executor's CPU kernels (csrc/cpu_kernels.cpp: attention, norms, rotary, sampling helpers;
csrc/quant_kernels.cpp: quantized linear layers; csrc/amx_linear.cpp: bf16 products on AMX
tiles; csrc/mkl_linear.cpp: float32 products on MKL's packed sgemm; csrc/decoder_layers.cpp:
every layer in one call; csrc/lora_products.cpp: LoRA adapters' segmented products), built
once per machine and loaded as torch.ops.llm_cpu. Runs in the executor process.

The sources are compiled with the machine's C++ compiler against the installed torch's headers
and libraries, `-march=native` (or `$LLM_PIPELINE_CPU_ARCH`: another CPU's, for a build that
runs on a fleet's oldest CPU, or to run here the paths another CPU takes), into
`$LLM_PIPELINE_CACHE/kernels/<key>/`, where the key hashes the sources, the torch version,
the compiler, its command and the CPU's flags: a second start, or another executor, loads it
in milliseconds; a change to any of them builds anew (about 100 s on the 2-core test machine,
each source compiled at once). Builders take a file lock, so executors starting together
compile once. Where no compiler works, or `LLM_PIPELINE_CPU_KERNELS=0`, the eager forward
keeps its PyTorch path, and the executor's log says why.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import shutil
import subprocess
import sysconfig
import tempfile
import time
from pathlib import Path

import torch

from ipc.cache import cache_dir

logger = logging.getLogger(__name__)

SOURCES = tuple(Path(__file__).parent / "csrc" / name
                for name in ("cpu_kernels.cpp", "quant_kernels.cpp", "amx_linear.cpp",
                              "mkl_linear.cpp", "decoder_layers.cpp", "bf16_vector.cpp",
                              "moe_experts.cpp", "lora_products.cpp"))
HEADERS = tuple(Path(__file__).parent / "csrc" / name
                for name in ("vector_math.h", "amx_tiles.h", "work_queue.h", "work_pool.h",
                              "bf16_vector.h", "moe_routes.h", "kv_formats.h"))
ENV = "LLM_PIPELINE_CPU_KERNELS"  # "0": do not build or use them
ARCH_ENV = "LLM_PIPELINE_CPU_ARCH"  # g++'s -march (default native): e.g. icelake-server, no AMX
# All of a build: inside an executor's ready timeout (300 s by default); ~100 s on the idle
# 2-core test machine (cpu_kernels.cpp alone takes 70), more beside other work. The test
# suite builds first with more time (tests/conftest.py: pytest_configure).
BUILD_TIMEOUT_S = 200

_loaded: Path | None = None
_failure: str | None = None


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return os.uname().machine


def _compiler() -> str | None:
    return shutil.which(os.environ.get("CXX", "g++"))


def _flags() -> list[str]:
    root = Path(torch.__file__).parent
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    # -fopenmp: the kernels' threads are torch's (its libgomp is the one loaded already);
    # -ffp-contract=fast: multiply-adds fused (ISO C++ mode would leave them apart).
    arch = os.environ.get(ARCH_ENV, "native")
    return ["-O3", f"-march={arch}", "-ffp-contract=fast", "-std=c++20", "-fPIC", "-fopenmp",
            "-w", f"-D_GLIBCXX_USE_CXX11_ABI={abi}", f"-I{root / 'include'}",
            f"-I{root / 'include' / 'torch' / 'csrc' / 'api' / 'include'}",
            f"-I{sysconfig.get_paths()['include']}"]


def _compile_command(compiler: str, source: Path, obj: Path) -> list[str]:
    return [compiler, *_flags(), "-c", str(source), "-o", str(obj)]


def _link_command(compiler: str, objects: list[Path], out: Path) -> list[str]:
    root = Path(torch.__file__).parent
    return [compiler, "-shared", "-fopenmp", *map(str, objects), f"-L{root / 'lib'}",
            "-ltorch_cpu", "-lc10", f"-Wl,-rpath,{root / 'lib'}", "-o", str(out)]


def _compile_all(compiler: str, tmp: Path, out: Path, timeout_s: float) -> None:
    """Each source to an object at once (one compiler process each: the sources build in the
    time of the largest on as many cores), then the library linked; RuntimeError on a
    failure, subprocess.TimeoutExpired past timeout_s in all."""
    deadline = time.monotonic() + timeout_s
    objects = [tmp / f"{source.stem}.o" for source in SOURCES]
    running = [subprocess.Popen(_compile_command(compiler, source, obj), stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
               for source, obj in zip(SOURCES, objects, strict=True)]
    try:
        for process in running:
            _, stderr = process.communicate(timeout=max(1.0, deadline - time.monotonic()))
            if process.returncode != 0:
                raise RuntimeError(f"{compiler} failed (exit {process.returncode}): "
                                   f"{stderr.strip()[-2000:]}")
    finally:
        for process in running:
            if process.poll() is None:
                process.kill()
                process.wait()
    done = subprocess.run(_link_command(compiler, objects, out), capture_output=True,
                          text=True, timeout=max(1.0, deadline - time.monotonic()),
                          check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{compiler} failed to link (exit {done.returncode}): "
                           f"{done.stderr.strip()[-2000:]}")


def library_path(compiler: str) -> Path:
    """Where the build for these sources, torch, compiler, command and CPU lives."""
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True,
                             check=False).stdout.splitlines()[:1]
    command = [*_flags(), *map(str, SOURCES),
               *_link_command(compiler, [Path("x.o")], Path("out.so"))]
    sources = [s.read_text() for s in (*SOURCES, *HEADERS)]
    key = hashlib.sha256("\n".join([*sources, torch.__version__, *version, *command,
                                    _cpu_flags()]).encode()).hexdigest()[:16]
    return cache_dir() / "kernels" / key / "llm_cpu_kernels.so"


def build(compiler: str, again: bool = False, timeout_s: float = BUILD_TIMEOUT_S) -> Path:
    """The compiled library, building it first unless the cache has it (or `again`); a build
    that takes longer than timeout_s raises subprocess.TimeoutExpired."""
    path = library_path(compiler)
    if path.is_file() and not again:
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.parent / "build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another process may be building it right now
        if path.is_file() and not again:
            return path
        logger.info("building the CPU kernels (once per machine and torch version) into %s",
                    path.parent)
        with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
            staged = Path(tmp) / path.name
            _compile_all(compiler, Path(tmp), staged, timeout_s)
            os.replace(staged, path)
    return path


def load(build_timeout_s: float = BUILD_TIMEOUT_S) -> str | None:
    """Load the kernels into this process (once), building them first where the cache lacks
    them. None when loaded; else why they are not available, for the caller to log."""
    global _loaded, _failure
    if os.environ.get(ENV, "1") == "0":
        return f"{ENV}=0"
    if _loaded is not None or _failure is not None:
        return _failure
    compiler = _compiler()
    if compiler is None:
        _failure = f"no C++ compiler ({os.environ.get('CXX', 'g++')}) on PATH"
        return _failure
    try:
        path = build(compiler, timeout_s=build_timeout_s)
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:
        _failure = f"the build failed: {e}"
        return _failure
    try:
        torch.ops.load_library(str(path))
    except OSError as first:  # a damaged file in the cache: build it again, once
        logger.warning("the cached CPU kernels did not load (%s): building them again", first)
        try:
            torch.ops.load_library(str(build(compiler, again=True)))
        except (OSError, RuntimeError, subprocess.SubprocessError) as e:
            _failure = f"the library did not load: {e}"
            return _failure
    _loaded = path
    runtimes = _openmp_runtimes()
    if len(runtimes) > 1:  # e.g. a torch build that ships its libgomp under another name
        logger.warning("two OpenMP runtimes are loaded (%s): the CPU kernels' threads do not "
                       "follow torch.set_num_threads", ", ".join(runtimes))
    return None


def _openmp_runtimes() -> list[str]:
    """The OpenMP runtime libraries mapped into this process."""
    try:
        maps = Path("/proc/self/maps").read_text().splitlines()
    except OSError:
        return []
    return sorted({line.split()[-1] for line in maps
                   if "libgomp" in line or "libiomp" in line or "libomp" in line})


def available() -> bool:
    return load() is None


def op_missing(probe: str, lacking: str) -> str | None:
    """Why a kernel that depends on the CPU cannot run here (None: it can): the kernels are
    not loaded, or torch.ops.llm_cpu.<probe>() says this CPU lacks what it needs (`lacking`
    says what)."""
    why = load()
    if why is not None:
        return f"the CPU kernels are not available ({why})"
    if not getattr(torch.ops.llm_cpu, probe)():
        return lacking
    return None


def loaded() -> bool:
    """Whether the kernels are in this process already (this never builds or loads them)."""
    return _loaded is not None
