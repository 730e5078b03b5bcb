"""A running pipeline's endpoints (`pipeline.json` in its run directory): what a client in
another process reads to connect. Written by the launcher, read by PipelineClient.connect."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

from ipc.errors import ConfigError

ENDPOINTS_FILE = "pipeline.json"


@dataclass(frozen=True)
class Endpoints:
    """Where a running pipeline listens: what a client in another process needs to connect.
    The launcher writes the local ones (ipc://) to `<run dir>/pipeline.json` once every stage
    is ready; with `--listen HOST` it also serves tcp:// ones to remote clients (see
    PipelineClient.connect)."""

    model_name: str  # the id front ends serve the model under
    max_model_len: int
    tokenizers: tuple[str, ...]  # the tokenizer workers' request inboxes
    schedulers: tuple[str, ...]  # each engine's abort inbox (an abort goes to every one)
    status: str  # the launcher's status publisher
    reply: str  # where a client binds its reply socket: an ipc:// prefix, or "tcp://"
    key: str = ""  # PipelineConfig.keys.client_key: every frame a client sends starts with it
    # The run's CURVE server key (public half, z85; ipc/curve.py): what a remote client's
    # tcp:// sockets expect the pipeline to prove (empty for local, ipc:// endpoints).
    server_key: str = ""
    # The rank of each of `tokenizers` (empty: 0, 1, ...): stages that joined from other
    # hosts come after the launcher's own, and one that left leaves a gap.
    tokenizer_ranks: tuple[int, ...] = ()
    # The LoRA adapters served beside the model (--lora-modules): a request's `model` may
    # name one of them (ipc/lora.py).
    lora_names: tuple[str, ...] = ()

    def save(self, run_dir: str) -> Path:
        path = Path(run_dir) / ENDPOINTS_FILE
        tmp = path.with_suffix(".tmp")
        tmp.write_text(self.to_json())
        tmp.replace(path)  # readers never see a half-written file
        return path

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=1)

    @classmethod
    def from_json(cls, text: str) -> Endpoints:
        fields = json.loads(text)
        fields["tokenizers"] = tuple(fields["tokenizers"])
        fields["schedulers"] = tuple(fields["schedulers"])
        fields["tokenizer_ranks"] = tuple(fields.get("tokenizer_ranks", ()))
        fields["lora_names"] = tuple(fields.get("lora_names", ()))
        return cls(**fields)

    @classmethod
    def load(cls, run_dir: str | Path) -> Endpoints:
        path = Path(run_dir) / ENDPOINTS_FILE
        try:
            return cls.from_json(path.read_text())
        except FileNotFoundError:
            raise ConfigError(f"no running pipeline at {run_dir} (no {ENDPOINTS_FILE})") from None
