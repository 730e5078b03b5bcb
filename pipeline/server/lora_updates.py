"""LoRA adapters loaded and unloaded while the server runs (POST /v1/load_lora_adapter and
/v1/unload_lora_adapter, vLLM's routes and answers), in an API worker process: the names this
worker serves beside --lora-modules, and the folder each request under one carries to the
scheduler (SamplingParams.lora_path; stages/scheduler/adapters.py gives it an id and a slot)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

from ipc.errors import ConfigError
from ipc.lora import read_adapter
from ipc.messages import ErrorKind, SamplingParams
from pipeline.runtime.client import PipelineClient
from pipeline.server.errors import ApiError, bad


class RuntimeLoras:
    """The adapters loaded at run time in this worker: name -> absolute PEFT folder. One API
    worker only (serve.py refuses more): another worker would not know the names."""

    def __init__(self, max_rank: int, model_dir: str | None) -> None:
        self.max_rank, self.model_dir = max_rank, model_dir
        self.folders: dict[str, str] = {}
        self._loading: set[str] = set()  # names whose load has not answered yet

    def path_of(self, name: str) -> str:
        """The folder a request under adapter `name` carries ("": not loaded at run time)."""
        return self.folders.get(name, "")

    async def load(self, client: PipelineClient, served: tuple[str, ...], name: str,
                   folder: Any) -> str:
        """Load adapter `name` from `folder` (both from the body), refusing a name already
        served (`served`: the model and --lora-modules) and a folder read_adapter refuses;
        answers once a one-token request under it has run (the executor loaded it)."""
        if not isinstance(folder, str) or not folder:
            raise bad("lora_path", "lora_path must be a non-empty string: a PEFT adapter folder")
        if name in served or name in self.folders or name in self._loading:
            raise bad("lora_name", f"the LoRA adapter {name!r} has already been loaded")
        self._loading.add(name)
        try:
            await self._check_and_run(client, name, folder)
        finally:
            self._loading.discard(name)
        return f"Success: LoRA adapter '{name}' added successfully."

    async def _check_and_run(self, client: PipelineClient, name: str, folder: str) -> None:
        try:
            await asyncio.to_thread(read_adapter, name, folder, self.max_rank,
                                    self._num_layers())
        except ConfigError as exc:
            raise bad("lora_path", str(exc)) from None
        params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True,
                                lora_name=name, lora_path=str(Path(folder).resolve()))
        async for out in client.stream([0], params):
            if out.error is not None:
                raise ApiError(400 if out.error_kind == ErrorKind.INVALID_REQUEST else 500,
                               f"the LoRA adapter {name!r} could not serve: {out.error}",
                               "lora_path", "invalid_request_error")
        self.folders[name] = params.lora_path

    def unload(self, static: tuple[str, ...], name: str) -> str:
        """Forget adapter `name`: new requests naming it get a 404; those running finish."""
        if name in static:
            raise bad("lora_name", f"the LoRA adapter {name!r} was loaded at start "
                                   "(--lora-modules) and stays; only adapters loaded at run "
                                   "time unload")
        if self.folders.pop(name, None) is None:
            raise ApiError(404, f"the LoRA adapter {name!r} cannot be found", "lora_name",
                           "invalid_request_error", "model_not_found")
        return f"Success: LoRA adapter '{name}' removed successfully."

    def _num_layers(self) -> int | None:
        """The model's decoder layers (an adapter may name no other), from its config.json."""
        if self.model_dir is None:
            return None
        cfg = json.loads((Path(self.model_dir) / "config.json").read_text())
        layers = cfg.get("text_config", cfg).get("num_hidden_layers")
        return layers if isinstance(layers, int) else None
