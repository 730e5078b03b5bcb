"""Speculative decoding's configuration, parsed from `--speculative ngram:K[:N[:M]]`,
`--speculative draft:PATH:K[:QUANT]` or vLLM's `--speculative-config` JSON, and shared by the
launcher, the scheduler (which plans the drafts: n-gram proposals it makes itself, a draft
model's as placeholders) and the executor (whose rings are sized by K, and which runs a draft
model). See docs/ARCHITECTURE.md, "Speculative decoding"."""

from __future__ import annotations

import json
from dataclasses import dataclass

from ipc.errors import ConfigError

MAX_SPECULATIVE_TOKENS = 16  # drafts a row may carry; more is verified work seldom accepted
METHODS = ("ngram", "draft")
DRAFT_QUANTIZATIONS = ("int8", "int4")  # a draft model's weights quantized at load
# A draft model's passes cost about as much per row as the model's own forward at a small
# batch, and grow with the rows where the model's does not: past this many running
# sequences, drafting lost to plain steps (docs/BENCHMARKS.md, "Speculative decoding").
DRAFT_MAX_BATCH = 4
_HELP = ("--speculative takes ngram:K[:N[:M]] (K draft tokens per step, 1-16; matched "
         "n-grams of N down to M tokens, default 4 and 2), draft:PATH:K[:int8|int4] (a draft "
         "model's folder, with the target's vocabulary, optionally quantized at load), or "
         'vLLM\'s JSON {"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_max": '
         'N, "prompt_lookup_min": M} / {"method": "draft_model", "model": PATH, '
         '"num_speculative_tokens": K, "quantization": "int4"}, either with '
         '"disable_by_batch_size": B (no drafts while more than B sequences run; 0: drafts '
         f'at any batch; default: {DRAFT_MAX_BATCH} with a draft model, none with ngram)')


@dataclass(frozen=True)
class SpeculativeConfig:
    """`ngram`: each step, a decoding sequence's last N (down to M) tokens are looked up in
    its own prompt and output, and the K tokens that followed their latest earlier
    occurrence are proposed. `draft`: a smaller model of the same vocabulary (`model`, its
    weights optionally `quantization`) proposes K tokens greedily, in the executor, before
    the forward. Either way the executor verifies the drafts in the same forward."""

    method: str = "ngram"
    num_tokens: int = 4  # K
    ngram_max: int = 4  # N
    ngram_min: int = 2  # M
    model: str | None = None  # draft: the draft model's folder
    quantization: str | None = None  # draft: DRAFT_QUANTIZATIONS, or None (as stored)
    disable_by_batch_size: int | None = None  # None: the method's default (max_batch)

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ConfigError(f"speculative method {self.method!r} is not supported (only "
                              f"ngram: n-gram prompt lookup, and draft: a draft model). "
                              f"{_HELP}")
        if (self.method == "draft") != (self.model is not None):
            raise ConfigError(f"a draft model's folder goes with method draft, and only "
                              f"there. {_HELP}")
        if self.quantization is not None and (self.method != "draft" or self.quantization
                                              not in DRAFT_QUANTIZATIONS):
            raise ConfigError(f"a draft model's quantization is one of "
                              f"{', '.join(DRAFT_QUANTIZATIONS)}, got {self.quantization!r}. "
                              f"{_HELP}")
        if not 1 <= self.num_tokens <= MAX_SPECULATIVE_TOKENS:
            raise ConfigError(f"speculative K must be 1-{MAX_SPECULATIVE_TOKENS}, got "
                              f"{self.num_tokens}. {_HELP}")
        if self.disable_by_batch_size is not None and self.disable_by_batch_size < 0:
            raise ConfigError(f"disable_by_batch_size must be 0 or more, got "
                              f"{self.disable_by_batch_size}. {_HELP}")
        if not 1 <= self.ngram_min <= self.ngram_max <= 64:
            raise ConfigError(f"speculative n-gram sizes must satisfy 1 <= M <= N <= 64, got "
                              f"N={self.ngram_max} M={self.ngram_min}. {_HELP}")

    @property
    def is_draft_model(self) -> bool:
        return self.method == "draft"

    @property
    def max_batch(self) -> int | None:
        """Drafts only while at most this many sequences run (None: at any batch)."""
        if self.disable_by_batch_size is None:
            return DRAFT_MAX_BATCH if self.is_draft_model else None
        return self.disable_by_batch_size or None

    def describe(self) -> str:
        if self.is_draft_model:
            return (f"draft:{self.model}:{self.num_tokens}"
                    + (f":{self.quantization}" if self.quantization else ""))
        return f"ngram:{self.num_tokens}:{self.ngram_max}:{self.ngram_min}"


def parse_speculative(text: str | None) -> SpeculativeConfig | None:
    """`ngram:K[:N[:M]]`, vLLM's JSON object, or None/"" (off)."""
    if not text:
        return None
    text = text.strip()
    if text.startswith("{"):
        return _from_json(text)
    method, _, rest = text.partition(":")
    if method == "draft":
        return _draft(text, rest)
    if method != "ngram":
        raise ConfigError(f"speculative method {method!r} is not supported (only ngram: "
                          f"n-gram prompt lookup, and draft: a draft model). {_HELP}")
    try:
        numbers = [int(x) for x in rest.split(":")] if rest else []
    except ValueError:
        raise ConfigError(f"cannot read --speculative {text!r}. {_HELP}") from None
    if not 1 <= len(numbers) <= 3:
        raise ConfigError(f"cannot read --speculative {text!r}. {_HELP}")
    k = numbers[0]
    n = numbers[1] if len(numbers) > 1 else 4
    m = numbers[2] if len(numbers) > 2 else min(2, n)
    return SpeculativeConfig("ngram", k, n, m)


def _draft(text: str, rest: str) -> SpeculativeConfig:
    """draft:PATH:K[:QUANT] (the folder may hold colons: K and QUANT are read from the end)."""
    head, _, last = rest.rpartition(":")
    quantization = None
    if last in DRAFT_QUANTIZATIONS:
        quantization = last
        head, _, last = head.rpartition(":")
    if not head or not last.isdigit():
        raise ConfigError(f"cannot read --speculative {text!r}. {_HELP}")
    return SpeculativeConfig("draft", int(last), model=head, quantization=quantization)


def _from_json(text: str) -> SpeculativeConfig:
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"--speculative-config is not JSON: {exc}. {_HELP}") from None
    if not isinstance(obj, dict):
        raise ConfigError(f"--speculative-config must be a JSON object. {_HELP}")
    known = {"method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min",
             "model", "quantization", "disable_by_batch_size"}
    unknown = sorted(set(obj) - known)
    if unknown:
        raise ConfigError(f"--speculative-config: unsupported key(s) {', '.join(unknown)}. "
                          f"{_HELP}")
    if "num_speculative_tokens" not in obj:
        raise ConfigError(f"--speculative-config needs num_speculative_tokens. {_HELP}")
    sizes = {"num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min",
             "disable_by_batch_size"}
    values = {k: obj[k] for k in sizes if k in obj}
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in values.values()):
        raise ConfigError(f"--speculative-config: the sizes must be integers. {_HELP}")
    model, quantization = obj.get("model"), obj.get("quantization")
    if not all(v is None or isinstance(v, str) for v in (model, quantization)):
        raise ConfigError(f"--speculative-config: model and quantization are strings. {_HELP}")
    # vLLM names the method draft_model (and infers it from a model given without one)
    method = str(obj.get("method", "draft" if model is not None else "ngram"))
    method = "draft" if method == "draft_model" else method
    n = obj.get("prompt_lookup_max", 4)
    return SpeculativeConfig(method, obj["num_speculative_tokens"], n,
                             obj.get("prompt_lookup_min", min(2, n)), model, quantization,
                             obj.get("disable_by_batch_size"))
