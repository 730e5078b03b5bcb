"""logit_bias through the scheduler and the model (the in-process engine): +100 on a token
forces it, greedy or sampled, with run-ahead and with speculative decoding (drafts verified by
the biased sampler); a request beside it samples as it does alone; and a slot that a biased
sequence held carries nothing over to the next."""

from __future__ import annotations

from pathlib import Path

import pytest

from ipc.messages import SamplingParams
from ipc.speculative import SpeculativeConfig
from stages.inprocess import InProcessEngine

PROMPTS = [[5, 9, 13, 40], [7, 8, 9], [11, 12, 13, 14, 15]]
FORCED = 17


@pytest.mark.parametrize("speculative", [None, SpeculativeConfig("ngram", 3, 2, 1)],
                         ids=["plain", "ngram"])
def test_a_bias_of_100_forces_its_token_and_leaves_the_batch_alone(
        tiny_model_dir: Path, speculative: SpeculativeConfig | None) -> None:
    engine = InProcessEngine(str(tiny_model_dir), depth=2, max_num_seqs=2,
                             speculative=speculative)
    plain = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    alone = engine.generate(PROMPTS, plain)
    first = alone[1][0]
    results = engine.run([
        ("greedy", PROMPTS[0], SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True,
                                              logit_bias={FORCED: 100.0})),
        ("sampled", PROMPTS[1], SamplingParams(max_tokens=10, temperature=1.0, seed=3,
                                               ignore_eos=True, logit_bias={FORCED: 100})),
        ("banned", PROMPTS[1], SamplingParams(max_tokens=1, temperature=0.0,
                                              logit_bias={first: -100.0})),
        ("plain", PROMPTS[2], plain)])
    assert results["greedy", 0].token_ids == [FORCED] * 10
    assert results["sampled", 0].token_ids == [FORCED] * 10
    assert results["banned", 0].token_ids[0] != first
    assert results["plain", 0].token_ids == alone[2]
    # the slots the biased sequences held, taken again without a bias: as at first
    assert engine.generate(PROMPTS, plain) == alone


@pytest.mark.parametrize("bias, words", [
    ({5: 100.5}, "[-100, 100]"), ({5: float("nan")}, "[-100, 100]"), ({50: 1.0}, "vocabulary"),
    ({-1: 1.0}, "vocabulary"), ({t: 1.0 for t in range(301)}, "at most 300")])
def test_a_bad_logit_bias_is_refused_never_clamped(bias: dict, words: str) -> None:
    from ipc.params import RequestError, validate_params

    with pytest.raises(RequestError, match="logit_bias") as err:
        validate_params(SamplingParams(logit_bias=bias), 50 if len(bias) < 300 else 1000)
    assert err.value.param == "logit_bias" and words in err.value.message
    validate_params(SamplingParams(logit_bias={5: -100, 6: 100}), 50)
