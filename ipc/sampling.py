"""The codec of per-slot sampling parameters: how a sequence's `SamplingParams` become the two
rows (float32 and int64 columns) that the scheduler lays into the step-input ring when the
sequence takes an executor slot, and that the executor keeps per slot on the host and on the
device. The only place that knows the columns."""

from __future__ import annotations

import enum

import numpy as np

from ipc.messages import SamplingParams

_MASK64 = (1 << 64) - 1


class F(enum.IntEnum):
    """float32 columns."""

    TEMPERATURE = 0
    TOP_P = 1
    MIN_P = 2
    REPETITION = 3
    PRESENCE = 4
    FREQUENCY = 5


class I(enum.IntEnum):  # noqa: E742 (I for int columns, beside F)
    """int64 columns."""

    TOP_K = 0
    MIN_TOKENS = 1
    PROMPT_LEN = 2
    SEED = 3
    HAS_SEED = 4
    LOGPROBS = 5  # -1: none
    LOGIT_BIAS = 6  # how many (id, bias) pairs the slot's row of the bias table holds


NUM_F, NUM_I = len(F), len(I)
SlotRow = tuple[list[float], list[int]]


def sample_seed(seed: int | None, index: int) -> int | None:
    """Sample `index`'s own seed: the request's seed for sample 0, a mix of both for the rest
    (so n samples differ, and each is reproducible on its own)."""
    if seed is None or index == 0:
        return seed
    mixed = ((seed & _MASK64) * 0x9E3779B97F4A7C15 + index * 0xBF58476D1CE4E5B9) & _MASK64
    return mixed - (1 << 64) if mixed >= 1 << 63 else mixed


def encode_slot(p: SamplingParams, num_prompt_tokens: int = 0, index: int = 0) -> SlotRow:
    """The slot rows of sample `index` of a request with params `p`."""
    seed = sample_seed(p.seed, index)
    floats = [p.temperature, p.top_p, p.min_p, p.repetition_penalty, p.presence_penalty,
              p.frequency_penalty]
    ints = [max(p.top_k, 0), p.min_tokens, num_prompt_tokens, 0 if seed is None else seed,
            seed is not None, -1 if p.logprobs is None else p.logprobs, len(p.logit_bias)]
    return floats, ints


GREEDY_SLOT: SlotRow = encode_slot(SamplingParams(temperature=0.0))  # an idle slot's rows


def penalty_rows(f: np.ndarray) -> np.ndarray:
    """Which rows of float columns f [..., NUM_F] apply a penalty."""
    return (f[..., F.REPETITION] != 1) | (f[..., F.PRESENCE] != 0) | (f[..., F.FREQUENCY] != 0)


def uses_penalties(p: SamplingParams) -> bool:
    return bool(penalty_rows(np.asarray(encode_slot(p)[0], dtype=np.float32)))
