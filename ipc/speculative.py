"""Speculative decoding's configuration, parsed from `--speculative ngram:K[:N[:M]]` or vLLM's
`--speculative-config` JSON, and shared by the launcher, the scheduler (which proposes and
plans the drafts) and the executor (whose rings are sized by K). See docs/ARCHITECTURE.md,
"Speculative decoding"."""

from __future__ import annotations

import json
from dataclasses import dataclass

from ipc.errors import ConfigError

MAX_SPECULATIVE_TOKENS = 16  # drafts a row may carry; more is verified work seldom accepted
METHODS = ("ngram",)
_HELP = ("--speculative takes ngram:K[:N[:M]] (K draft tokens per step, 1-16; matched "
         "n-grams of N down to M tokens, default 4 and 2), or vLLM's JSON "
         '{"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_max": N, '
         '"prompt_lookup_min": M}')


@dataclass(frozen=True)
class SpeculativeConfig:
    """n-gram prompt lookup: each step, a decoding sequence's last N (down to M) tokens are
    looked up in its own prompt and output, and the K tokens that followed their latest
    earlier occurrence are proposed; the executor verifies them in the same forward."""

    method: str = "ngram"
    num_tokens: int = 4  # K
    ngram_max: int = 4  # N
    ngram_min: int = 2  # M

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ConfigError(f"speculative method {self.method!r} is not supported (only "
                              f"{', '.join(METHODS)}: n-gram prompt lookup). {_HELP}")
        if not 1 <= self.num_tokens <= MAX_SPECULATIVE_TOKENS:
            raise ConfigError(f"speculative K must be 1-{MAX_SPECULATIVE_TOKENS}, got "
                              f"{self.num_tokens}. {_HELP}")
        if not 1 <= self.ngram_min <= self.ngram_max <= 64:
            raise ConfigError(f"speculative n-gram sizes must satisfy 1 <= M <= N <= 64, got "
                              f"N={self.ngram_max} M={self.ngram_min}. {_HELP}")

    def describe(self) -> str:
        return f"ngram:{self.num_tokens}:{self.ngram_max}:{self.ngram_min}"


def parse_speculative(text: str | None) -> SpeculativeConfig | None:
    """`ngram:K[:N[:M]]`, vLLM's JSON object, or None/"" (off)."""
    if not text:
        return None
    text = text.strip()
    if text.startswith("{"):
        return _from_json(text)
    method, _, rest = text.partition(":")
    if method != "ngram":
        raise ConfigError(f"speculative method {method!r} is not supported (only ngram: "
                          f"n-gram prompt lookup; a draft model is not built yet). {_HELP}")
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


def _from_json(text: str) -> SpeculativeConfig:
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"--speculative-config is not JSON: {exc}. {_HELP}") from None
    if not isinstance(obj, dict):
        raise ConfigError(f"--speculative-config must be a JSON object. {_HELP}")
    known = {"method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min"}
    unknown = sorted(set(obj) - known)
    if unknown:
        raise ConfigError(f"--speculative-config: unsupported key(s) {', '.join(unknown)}. "
                          f"{_HELP}")
    if "num_speculative_tokens" not in obj:
        raise ConfigError(f"--speculative-config needs num_speculative_tokens. {_HELP}")
    values = {k: obj[k] for k in known - {"method"} if k in obj}
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in values.values()):
        raise ConfigError(f"--speculative-config: the sizes must be integers. {_HELP}")
    n = obj.get("prompt_lookup_max", 4)
    return SpeculativeConfig(str(obj.get("method", "ngram")), obj["num_speculative_tokens"], n,
                             obj.get("prompt_lookup_min", min(2, n)))
