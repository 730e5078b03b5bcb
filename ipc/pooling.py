"""How a model pools its hidden states into one embedding (POST /v1/embeddings, LLM.embed):
read from its folder without torch (a sentence-transformers `modules.json` with its
`1_Pooling/config.json` and `Normalize` module where present), and the front ends' last step
on a pooled vector (Matryoshka truncation, normalisation). Used by the front ends; the
executor gets a row's mode as its code (`POOLING_CODES`) in the step ring."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ipc.errors import ConfigError
from ipc.messages import SamplingParams
from ipc.params import POOLING_MODES

# A row's pooling in the step ring (ipc/step.py StepRow.pooling); 0: the row generates.
POOLING_CODES = {mode: code for code, mode in enumerate(POOLING_MODES, 1)}
LAST, MEAN, CLS = (POOLING_CODES[m] for m in ("last", "mean", "cls"))
# sentence-transformers' pooling_mode_* keys, by our name; the other modes are refused.
_ST_MODES = {"pooling_mode_lasttoken": "last", "pooling_mode_mean_tokens": "mean",
             "pooling_mode_cls_token": "cls"}
_ST_UNSUPPORTED = ("pooling_mode_max_tokens", "pooling_mode_mean_sqrt_len_tokens",
                   "pooling_mode_weightedmean_tokens")
_ST_MODULE = "sentence_transformers.models."


@dataclass(frozen=True)
class PoolingConfig:
    """mode: last, mean or cls (the final norm's output: the last prompt token's, the mean
    over every prompt token, the first token's); normalize: scale to unit length;
    matryoshka_dimensions: the sizes the model was trained to be cut to (None: it declares
    none, and a request's `dimensions` is refused); source: where the choice came from."""

    mode: str = "last"
    normalize: bool = True
    matryoshka_dimensions: tuple[int, ...] | None = None
    source: str = "default (last token, normalised: vLLM's for decoder models)"

    @classmethod
    def from_dir(cls, path: str | Path) -> PoolingConfig:
        """The folder's pooling: its sentence-transformers modules if it has them, else
        last-token pooling, normalised (as vLLM pools a decoder model by default). A
        pooling mode the engine lacks (max, mean_sqrt_len, weightedmean) raises
        ConfigError."""
        path = Path(path)
        dims = _matryoshka(path)
        modules_file = path / "modules.json"
        if not modules_file.is_file():
            return cls(matryoshka_dimensions=dims)
        modules = json.loads(modules_file.read_text())
        kinds = {m.get("type", "").removeprefix(_ST_MODULE): m.get("path", "") for m in modules}
        normalize = "Normalize" in kinds
        if "Pooling" not in kinds:
            return cls("last", normalize, dims, f"{modules_file} (no Pooling module: last)")
        pool_file = path / kinds["Pooling"] / "config.json"
        pool = json.loads(pool_file.read_text())
        bad = [k for k in _ST_UNSUPPORTED if pool.get(k)]
        modes = [mode for key, mode in _ST_MODES.items() if pool.get(key)]
        if bad or len(modes) != 1:
            raise ConfigError(f"{pool_file} asks for pooling {bad or modes or 'none'}: the "
                              "engine pools by exactly one of lasttoken, mean_tokens, cls_token")
        return cls(modes[0], normalize, dims, str(pool_file))

    def params(self, user: str = "") -> SamplingParams:
        """An embedding request's SamplingParams: its prompt computed, pooled this way, the
        one token its last chunk samples dropped (the server's and LLM.embed's)."""
        return SamplingParams(max_tokens=1, temperature=0.0, user=user, pooling=self.mode,
                              speculate=False)

    def check_dimensions(self, dimensions: int | None) -> str | None:
        """Why `dimensions` cannot be served (None: it can, or none was asked)."""
        if dimensions is None:
            return None
        if self.matryoshka_dimensions is None:
            return ("this model declares no Matryoshka dimensions (config.json "
                    "matryoshka_dimensions), so its embeddings cannot be shortened")
        if dimensions not in self.matryoshka_dimensions:
            return (f"dimensions must be one of this model's Matryoshka dimensions "
                    f"{list(self.matryoshka_dimensions)}, got {dimensions}")
        return None

    def finish(self, raw: bytes, dimensions: int | None = None) -> np.ndarray:
        """A pooled vector as the client gets it [hidden or dimensions] float32: cut to
        `dimensions` (already checked), then normalised if the model says so."""
        vector = np.frombuffer(raw, "<f4").astype(np.float32)
        if dimensions is not None:
            vector = vector[:dimensions]
        if self.normalize:  # (as torch.nn.functional.normalize: eps 1e-12)
            vector = vector / max(float(np.linalg.norm(vector)), 1e-12)
        return vector  # type: ignore[no-any-return]


def _matryoshka(path: Path) -> tuple[int, ...] | None:
    """config.json's `matryoshka_dimensions` (vLLM's key), if it has them."""
    config_file = path / "config.json"
    config = json.loads(config_file.read_text()) if config_file.is_file() else {}
    dims = config.get("matryoshka_dimensions")
    if dims is None:
        return None
    if not (isinstance(dims, list) and all(isinstance(d, int) and d > 0 for d in dims)):
        raise ConfigError(f"{config_file}: matryoshka_dimensions must be a list of sizes")
    return tuple(dims)
