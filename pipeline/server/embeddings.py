"""POST /v1/embeddings (OpenAI's shape) in the HTTP front end's workers: the request parsed into
pooling requests, one per input (ipc/pooling.py for how the model pools), and the vectors
rendered as floats or base64. Run through the same Generation as the other routes (admission,
rate limits, a hang-up aborts)."""

from __future__ import annotations

import base64
import functools
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from ipc.errors import ConfigError
from ipc.pooling import PoolingConfig
from pipeline.server.errors import ApiError, bad
from pipeline.server.openai_parse import ParsedRequest, _get, check_fields, parse_prompts

if TYPE_CHECKING:
    from pipeline.server.generation import Generation

EMBEDDING_FIELDS = frozenset({"model", "input", "encoding_format", "dimensions", "user"})


@dataclass(frozen=True)
class EmbeddingRequest:
    parsed: ParsedRequest  # one prompt per input, pooling as the model does
    encoding_format: str  # float or base64
    dimensions: int | None  # a Matryoshka size (checked), None: the model's


@functools.cache
def model_pooling(model_dir: str | None) -> PoolingConfig:
    """How the model pools an embedding (its folder's sentence-transformers modules, else the
    last token, normalised), read once; a pooling the engine lacks is a 400 naming `model`."""
    try:
        return PoolingConfig.from_dir(model_dir) if model_dir is not None else PoolingConfig()
    except ConfigError as exc:
        raise bad("model", f"this model's embeddings cannot be served: {exc}") from None


def parse_embeddings(body: dict[str, Any], vocab_size: int,
                     pooling: PoolingConfig) -> EmbeddingRequest:
    """The request, or a 400 naming the field at fault."""
    check_fields(body, EMBEDDING_FIELDS)
    prompts = parse_prompts(body.get("input"), vocab_size, "input", empty_text=False)
    fmt = _get(body, "encoding_format", (str,), "float")
    if fmt not in ("float", "base64"):
        raise bad("encoding_format", f"encoding_format must be float or base64, got {fmt!r}")
    dimensions = _get(body, "dimensions", (int,))
    if dimensions is not None and dimensions < 1:
        raise bad("dimensions", f"dimensions must be at least 1, got {dimensions}")
    why = pooling.check_dimensions(dimensions)
    if why is not None:
        raise bad("dimensions", why)
    user = _get(body, "user", (str,), "")
    params = pooling.params(user)
    return EmbeddingRequest(ParsedRequest(prompts, params), fmt, dimensions)


async def collect_embeddings(run: Generation, req: EmbeddingRequest, pooling: PoolingConfig,
                             model: str) -> dict[str, Any]:
    """OpenAI's embeddings response, once every input's vector is in."""
    vectors: dict[int, bytes] = {}
    async for i, out in run.outputs():
        if out.finished and out.error:
            raise ApiError(500, f"the engine failed the request: {out.error}", None,
                           "server_error")
        if out.embedding is not None:
            vectors[i] = out.embedding
    if len(vectors) != len(req.parsed.prompts):
        raise ApiError(500, "the engine finished an input without its vector", None,
                       "server_error")
    data = []
    for i in range(len(req.parsed.prompts)):
        vector = pooling.finish(vectors[i], req.dimensions)
        data.append({"object": "embedding", "index": i,
                     "embedding": _encoded(vector, req.encoding_format)})
    tokens = sum(run.prompt_tokens)
    return {"object": "list", "data": data, "model": model,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}


def _encoded(vector: np.ndarray, fmt: str) -> Any:
    """float: a list of numbers; base64: the little-endian float32 bytes (the OpenAI SDK's
    default: it asks for base64 and decodes them with numpy's float32)."""
    if fmt == "base64":
        return base64.b64encode(vector.astype("<f4").tobytes()).decode()
    return vector.tolist()


def new_embedding_id() -> str:
    return "embd-" + uuid.uuid4().hex
