"""SamplingParams validation in the tokenizer stage (one clear error naming the parameter,
nothing clamped) and the CLI flags that map onto it one to one."""

from __future__ import annotations

import dataclasses
import math

import pytest

from ipc.messages import SamplingParams, StructuredOutputs
from ipc.params import RequestError, validate_params
from pipeline.cli import build_parser, sampling_params

BAD = [
    ({"min_tokens": -1}, "min_tokens must be >= 0"),
    ({"min_tokens": 5, "max_tokens": 4}, r"min_tokens \(5\) must not exceed max_tokens \(4\)"),
    ({"top_p": 0.0}, r"top_p must be in \(0, 1\]"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_p": math.nan}, "top_p"),
    ({"top_k": -2}, "top_k must be -1 or 0"),
    ({"min_p": -0.1}, r"min_p must be in \[0, 1\]"),
    ({"min_p": 1.01}, "min_p"),
    ({"seed": 2**63}, "seed must fit in 64 bits"),
    ({"repetition_penalty": 0.0}, "repetition_penalty must be a finite number > 0"),
    ({"repetition_penalty": math.inf}, "repetition_penalty"),
    ({"presence_penalty": 2.5}, r"presence_penalty must be in \[-2, 2\]"),
    ({"frequency_penalty": -3.0}, "frequency_penalty"),
    ({"stop": ["ok", ""]}, "stop strings must not be empty"),
    ({"stop": [str(i) for i in range(65)]}, "at most 64 stop strings, got 65"),
    ({"stop": ["x" * 257]}, "stop strings must be at most 256 characters, got 257"),
    ({"n": 0}, "n must be between 1 and 128"),
    ({"n": 129}, "n must be between 1 and 128"),
    ({"logprobs": 21}, "logprobs must be between 0 and 20"),
    ({"logprobs": -1}, "logprobs"),
    ({"stop_token_ids": list(range(65))}, "at most 64 stop_token_ids"),
    ({"stop_token_ids": [100]}, r"outside the vocabulary \[0, 100\)"),
]


@pytest.mark.parametrize(("fields", "message"), BAD, ids=[str(f) for f, _ in BAD])
def test_a_bad_parameter_is_named(fields: dict[str, object], message: str) -> None:
    with pytest.raises(RequestError, match=message) as info:
        validate_params(SamplingParams(**fields), 100)  # type: ignore[arg-type]
    named = "min_tokens" if "max_tokens" in fields else next(iter(fields))
    assert info.value.param == named  # the field itself, not parsed out of the message


GOOD = [{"stop": [str(i) for i in range(64)]}, {"stop": ["x" * 256]},
        {"top_k": -1}, {"top_k": 0}, {"top_k": 1}, {"top_p": 1.0}, {"top_p": 0.01},
        {"min_p": 1.0}, {"seed": -(2**63)}, {"seed": 2**63 - 1}, {"presence_penalty": -2.0},
        {"frequency_penalty": 2.0}, {"n": 128}, {"logprobs": 0}, {"logprobs": 20},
        {"min_tokens": 4, "max_tokens": 4}, {"stop": ["a", "bc"]}, {"priority": -5}]


@pytest.mark.parametrize("fields", GOOD, ids=[str(f) for f in GOOD])
def test_edge_values_are_accepted(fields: dict[str, object]) -> None:
    validate_params(SamplingParams(**fields), 100)  # type: ignore[arg-type]


def test_every_parameter_has_a_cli_flag() -> None:
    argv = ["generate", "--prompt", "hi", "--max-tokens", "9", "--min-tokens", "2",
            "--temperature", "0.5", "--top-p", "0.9", "--top-k", "7", "--min-p", "0.05",
            "--seed", "3", "--repetition-penalty", "1.1", "--presence-penalty", "0.2",
            "--frequency-penalty", "0.3", "--stop", "a", "--stop", "b c", "--stop-token-ids",
            "5", "6", "--ignore-eos", "--include-stop-str-in-output",
            "--no-skip-special-tokens", "--n", "2", "--logprobs", "4", "--priority", "-1",
            "--user", "u", "--regex", "a+", "--prompt-logprobs", "3", "--logit-bias", "5=-100",
            "--logit-bias", "7=2.5"]
    params = sampling_params(build_parser().parse_args(argv))
    assert params == SamplingParams(
        max_tokens=9, temperature=0.5, stop_token_ids=[5, 6], ignore_eos=True,
        skip_special_tokens=False, min_tokens=2, top_p=0.9, top_k=7, min_p=0.05, seed=3,
        repetition_penalty=1.1, presence_penalty=0.2, frequency_penalty=0.3, stop=["a", "b c"],
        include_stop_str_in_output=True, n=2, logprobs=4, priority=-1, user="u",
        structured_outputs=StructuredOutputs(regex="a+"), prompt_logprobs=3,
        logit_bias={5: -100.0, 7: 2.5})
    defaults = sampling_params(build_parser().parse_args(["generate", "--prompt", "hi"]))
    # the CLI is greedy and bounds the length by default
    assert defaults == dataclasses.replace(SamplingParams(), temperature=0.0, max_tokens=256)
