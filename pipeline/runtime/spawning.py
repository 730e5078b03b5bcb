"""Creating a run on this host and starting its stages: the device check, the run directory
and secrets, every stage process in the order the engines need, and the run's files removed
at the end. Runs in the launcher's process (Pipeline.start and stop)."""

from __future__ import annotations

import dataclasses
import os
import secrets
import shutil
import uuid

import zmq

from ipc import curve
from ipc.channels import make_run_dir
from ipc.config import PipelineConfig
from ipc.errors import ConfigError
from ipc.keys import derive_run_secret
from pipeline.runtime.supervisor import Reports, Supervisor
from stages.trace import merge_traces

CUDA_INSTALL = ("pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128 "
                "(into this environment; pick the index of your CUDA driver's version)")


def check_device(device: str) -> None:
    """A CUDA device the executor will find, or ConfigError saying why not and what to do."""
    if not device.startswith("cuda"):
        return
    import torch  # (only for a CUDA device: the launcher's process needs no torch otherwise)

    if torch.version.cuda is None:
        raise ConfigError(f"--device {device}: this torch ({torch.__version__}) is a CPU build, "
                          f"without CUDA. For a GPU: {CUDA_INSTALL}")
    count = torch.cuda.device_count()
    index = int(device.partition(":")[2] or 0)
    if count == 0:
        raise ConfigError(f"--device {device}: torch {torch.__version__} has CUDA, but sees no "
                          "GPU (check the driver with nvidia-smi, and CUDA_VISIBLE_DEVICES)")
    if index >= count:
        raise ConfigError(f"--device {device}: there are {count} GPU(s), cuda:0 to "
                          f"cuda:{count - 1}")


def create_run(cfg: PipelineConfig, trace: bool) -> PipelineConfig:
    """The run directory (sockets, trace files if `trace`), the run's id and secrets: `cfg`
    with them. (The rings are the executors' to create: a launcher killed before it spawned
    one leaves none.)"""
    run_dir = make_run_dir()
    trace_dir = ""
    if trace:
        trace_dir = str(run_dir / "trace")
        os.mkdir(trace_dir)
    run_id = uuid.uuid4().hex[:12]
    # Derived from the stage key where stages may join (they derive the same), else new.
    keys = cfg.keys
    secret = (derive_run_secret(keys.stage_key, run_id) if keys.stage_key
              else secrets.token_bytes(16))
    # The CURVE server key of the run's tcp:// endpoints (ipc/curve.py): derived alike.
    curve_secret = b""
    if cfg.remote.listen_host:
        curve_secret = (curve.derived_server_secret(keys.stage_key, run_id)
                        if keys.stage_key else zmq.curve_keypair()[1])
    run_keys = dataclasses.replace(keys, run_secret=secret, curve_secret=curve_secret,
                                   client_key=keys.client_key or secrets.token_urlsafe(24))
    return dataclasses.replace(cfg, run_dir=str(run_dir), run_id=run_id, trace_dir=trace_dir,
                               keys=run_keys)


def spawn_stages(sup: Supervisor, cfg: PipelineConfig, reports: Reports) -> None:
    """Start every stage of the run and wait until each is ready (StartupError if one is
    not). Every process loads at once; each scheduler starts once its engine's cache size
    is known (its head executor rank's ready report). Engines with joined pipeline stages
    are not started here: each starts once the host of those stages joins (launcher.py)."""
    engines = range(0 if cfg.ranks.joined_stages else cfg.data_parallel_size)
    for engine in engines:
        sup.spawn_executors(engine)
    for rank in range(cfg.num_tokenizers):
        sup.spawn_stage("tokenizer", rank)
    for rank in range(cfg.num_detokenizers):
        sup.spawn_stage("detokenizer", rank)
    for engine in engines:
        sup.start_scheduler(engine, reports)
    sup.wait_ready(list(sup.procs), reports)


def remove_run(cfg: PipelineConfig, names: list[str], trace_path: str | None) -> None:
    """Once every stage has stopped: merge their traces into `trace_path` (if tracing) and
    remove the run directory."""
    if not cfg.run_dir:
        return  # the run was never created
    if trace_path is not None:
        files = [os.path.join(cfg.trace_dir, f"{name.replace(':', '-')}.json") for name in names]
        merge_traces(files, trace_path)
    shutil.rmtree(cfg.run_dir, ignore_errors=True)
