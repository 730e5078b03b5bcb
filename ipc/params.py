"""What a request may ask for: the limits of `SamplingParams` and their validation, shared by
the tokenizer stage (which checks every request) and the front ends (which name the field)."""

from __future__ import annotations

import math

from ipc.messages import SamplingParams

MAX_N = 128  # samples per request
MAX_STOP_TOKEN_IDS = 64
# Stop strings are searched after every token of the sample: their number and length bound
# the detokenizer's work per token (5,000 of them once stalled every stream for a minute).
MAX_STOP_STRINGS = 64
MAX_STOP_STRING_CHARS = 256
MAX_TOP_LOGPROBS = 20  # alternatives per token: the width of the sampled-token ring
MAX_RECONCILE_IDS = 4096  # ids one Reconcile may name (a client sends several if need be)
MAX_USER_CHARS = 256  # SamplingParams.user: the scheduler keeps one entry per active user
# A structured output's schema, regex or grammar (its text), and its number of choices.
MAX_STRUCTURED_CHARS = 1 << 17
MAX_CHOICES = 1024
# logit_bias entries per request: OpenAI's own limit (300). Each executor slot keeps this many
# (id, bias) pairs on the device, so it bounds that table and a step's work.
MAX_LOGIT_BIAS = 300
MAX_ABS_LOGIT_BIAS = 100.0  # OpenAI's range, [-100, 100]
# The priorities a caller may use unless the engine is started with another --priority-range:
# a caller may make its own requests less urgent (batch work), never jump ahead of others.
DEFAULT_PRIORITY_RANGE = (0, 10)
_INT32 = 2**31
_INT64 = 2**63


class RequestError(ValueError):
    """A request a client must fix. `param` names the offending field (None: the request as
    a whole); the message says what is wrong."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message, self.param = message, param


def _check(ok: bool, param: str, message: str) -> None:
    if not ok:
        raise RequestError(message, param)


def validate_params(p: SamplingParams, vocab_size: int,
                    priority_range: tuple[int, int] | None = None) -> None:
    """Raise RequestError naming the first parameter out of its range; nothing is clamped.
    priority_range: the (most, least) urgent priority the engine lets callers ask for (the
    stages check it; a front end that does not know the engine's range passes None)."""
    for name in ("max_tokens", "min_tokens", "top_k", "priority", "n", "logprobs",
                 "prompt_logprobs"):
        value = getattr(p, name)
        _check(value is None or -_INT32 <= value < _INT32, name,
               f"{name} must fit in 32 bits, got {value}")
    _check(p.max_tokens is None or p.max_tokens >= 1, "max_tokens",
           f"max_tokens must be at least 1, got {p.max_tokens}")
    _check(p.min_tokens >= 0, "min_tokens", f"min_tokens must be >= 0, got {p.min_tokens}")
    _check(p.max_tokens is None or p.min_tokens <= p.max_tokens, "min_tokens",
           f"min_tokens ({p.min_tokens}) must not exceed max_tokens ({p.max_tokens})")
    _check(math.isfinite(p.temperature) and p.temperature >= 0, "temperature",
           f"temperature must be a finite number >= 0, got {p.temperature}")
    _check(math.isfinite(p.top_p) and 0 < p.top_p <= 1, "top_p",
           f"top_p must be in (0, 1], got {p.top_p}")
    _check(p.top_k >= -1, "top_k",
           f"top_k must be -1 or 0 (off) or a positive count, got {p.top_k}")
    _check(math.isfinite(p.min_p) and 0 <= p.min_p <= 1, "min_p",
           f"min_p must be in [0, 1], got {p.min_p}")
    _check(p.seed is None or -_INT64 <= p.seed < _INT64, "seed",
           f"seed must fit in 64 bits, got {p.seed}")
    _check(math.isfinite(p.repetition_penalty) and p.repetition_penalty > 0,
           "repetition_penalty",
           f"repetition_penalty must be a finite number > 0, got {p.repetition_penalty}")
    for name in ("presence_penalty", "frequency_penalty"):
        value = getattr(p, name)
        _check(math.isfinite(value) and -2 <= value <= 2, name,
               f"{name} must be in [-2, 2], got {value}")
    _check(all(p.stop), "stop", "stop strings must not be empty")
    _check(len(p.stop) <= MAX_STOP_STRINGS, "stop",
           f"at most {MAX_STOP_STRINGS} stop strings, got {len(p.stop)}")
    longest = max(map(len, p.stop), default=0)
    _check(longest <= MAX_STOP_STRING_CHARS, "stop",
           f"stop strings must be at most {MAX_STOP_STRING_CHARS} characters, got {longest}")
    _check(1 <= p.n <= MAX_N, "n", f"n must be between 1 and {MAX_N}, got {p.n}")
    _check(p.logprobs is None or 0 <= p.logprobs <= MAX_TOP_LOGPROBS, "logprobs",
           f"logprobs must be between 0 and {MAX_TOP_LOGPROBS}, got {p.logprobs}")
    _check(p.prompt_logprobs is None or 0 <= p.prompt_logprobs <= MAX_TOP_LOGPROBS,
           "prompt_logprobs",
           f"prompt_logprobs must be between 0 and {MAX_TOP_LOGPROBS}, got {p.prompt_logprobs}")
    lo, hi = priority_range or (-_INT32, _INT32)
    _check(lo <= p.priority <= hi, "priority",
           f"priority must be between {lo} and {hi} on this engine (lower is served first; "
           f"the operator sets the range with --priority-range), got {p.priority}")
    _check(len(p.user) <= MAX_USER_CHARS, "user",
           f"user must be at most {MAX_USER_CHARS} characters, got {len(p.user)}")
    _check(len(p.stop_token_ids) <= MAX_STOP_TOKEN_IDS, "stop_token_ids",
           f"at most {MAX_STOP_TOKEN_IDS} stop_token_ids, got {len(p.stop_token_ids)}")
    bad = [t for t in p.stop_token_ids if not 0 <= t < vocab_size]
    _check(not bad, "stop_token_ids",
           f"stop_token_ids {bad} are outside the vocabulary [0, {vocab_size})")
    if p.logit_bias:
        _validate_logit_bias(p, vocab_size)
    if p.structured_outputs is not None:
        _validate_structured(p)
    if p.reasoning is not None:
        tags = p.reasoning
        _check(0 <= tags.end_id < vocab_size and -1 <= tags.start_id < vocab_size, "reasoning",
               f"reasoning tag ids ({tags.start_id}, {tags.end_id}) are outside the "
               f"vocabulary [0, {vocab_size})")
    if p.pooling:
        _validate_pooling(p)


def _validate_logit_bias(p: SamplingParams, vocab_size: int) -> None:
    biases = p.logit_bias
    _check(len(biases) <= MAX_LOGIT_BIAS, "logit_bias",
           f"logit_bias may bias at most {MAX_LOGIT_BIAS} tokens, got {len(biases)}")
    outside = [b.token_id for b in biases if not 0 <= b.token_id < vocab_size]
    _check(not outside, "logit_bias",
           f"logit_bias token ids {outside[:5]} are outside the vocabulary [0, {vocab_size})")
    wrong = [b.bias for b in biases
             if not (math.isfinite(b.bias) and abs(b.bias) <= MAX_ABS_LOGIT_BIAS)]
    _check(not wrong, "logit_bias",
           f"logit_bias values must be numbers in [-{MAX_ABS_LOGIT_BIAS:g}, "
           f"{MAX_ABS_LOGIT_BIAS:g}], got {wrong[:5]}")
    ids = [b.token_id for b in biases]
    _check(len(set(ids)) == len(ids), "logit_bias", "logit_bias names a token id twice")



POOLING_MODES = ("last", "mean", "cls")  # ipc/pooling.py POOLING_CODES


def _validate_pooling(p: SamplingParams) -> None:
    """An embedding request computes its prompt once and samples nothing it keeps: what
    only a generation means is refused by name."""
    _check(p.pooling in POOLING_MODES, "pooling",
           f"pooling must be one of {list(POOLING_MODES)} (or empty to generate), "
           f"got {p.pooling!r}")
    _check(p.n == 1, "n", "an embedding request has one result: n must be 1")
    _check(p.max_tokens == 1, "max_tokens",
           "an embedding request computes its prompt only: max_tokens must be 1 (the one "
           "position after the prompt that its last chunk samples and drops)")
    for name in ("logprobs", "prompt_logprobs", "structured_outputs", "reasoning"):
        _check(getattr(p, name) is None, name, f"{name} cannot be asked of an embedding")
    for name in ("logit_bias", "stop", "stop_token_ids", "min_tokens"):
        _check(not getattr(p, name), name, f"{name} cannot be asked of an embedding (it "
                                           "samples no token it keeps)")
    _check(not p.lora_name, "lora_name", "embeddings are the model's own, not a LoRA "
                                         "adapter's (not supported)")


def room_for(p: SamplingParams) -> str:
    """What a prompt must leave room for in the context (its error's words): an output
    token, or an embedding's one position past the prompt (sampled and dropped: the engine
    computes every request alike)."""
    if p.pooling:
        return ("the one position past the prompt that an embedding's last chunk computes "
                "and drops")
    return "at least one output token"


def _validate_structured(p: SamplingParams) -> None:
    """The shape of a structured output (whether it compiles is the tokenizer stage's check,
    stages/grammar.py), and the parameters it cannot be combined with."""
    so, param = p.structured_outputs, "structured_outputs"
    assert so is not None
    kinds = so.kinds()
    _check(len(kinds) == 1, param, "structured_outputs must give exactly one of json, regex, "
                                   f"choice, grammar, json_object; got {kinds or 'none'}")
    size = sum(len(t) for t in (so.json, so.regex, so.grammar) if t is not None)
    size += sum(map(len, so.choice or ()))
    _check(size <= MAX_STRUCTURED_CHARS, param,
           f"the structured output's text has {size} characters; at most "
           f"{MAX_STRUCTURED_CHARS}")
    _check(so.choice is None or 1 <= len(so.choice) <= MAX_CHOICES, param,
           f"choice must have between 1 and {MAX_CHOICES} strings")
    # The format decides where the output ends (it allows only EOS once complete).
    _check(p.min_tokens == 0, "min_tokens",
           "min_tokens cannot be combined with a structured output: the format decides "
           "where the output ends")
    _check(not p.ignore_eos, "ignore_eos",
           "ignore_eos cannot be combined with a structured output: the format decides "
           "where the output ends")

