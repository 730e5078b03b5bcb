"""The sequence state machine and the scheduler's one stop check (stages/scheduler/)."""

from __future__ import annotations

import pytest
from scheduler_driver import Driver, make_limits, make_request

from ipc.messages import FinishReason, SamplingParams
from stages.scheduler.sequence import SeqStatus, Sequence
from stages.scheduler.stopping import Finish, check_stop, reaches_length, suppressed_ids

EOS = (2,)


def test_only_the_documented_transitions_are_allowed() -> None:
    seq = Sequence("r", [1, 2], SamplingParams(), 0.0)
    assert seq.status is SeqStatus.WAITING
    with pytest.raises(RuntimeError, match="no transition from waiting to preempting"):
        seq.move_to(SeqStatus.PREEMPTING)
    for status in (SeqStatus.RUNNING, SeqStatus.PREEMPTING, SeqStatus.WAITING,
                   SeqStatus.RUNNING, SeqStatus.FINISHED):
        seq.move_to(status)
    with pytest.raises(RuntimeError, match="no transition from finished to running"):
        seq.move_to(SeqStatus.RUNNING)
    held = Sequence("r", [1], SamplingParams(), 0.0, index=1, status=SeqStatus.HELD)
    with pytest.raises(RuntimeError, match="from held to running"):
        held.move_to(SeqStatus.RUNNING)  # a held sample goes through the queue first


def test_samples_are_held_until_the_first_prompt_is_planned() -> None:
    driver = Driver(make_limits(num_blocks=40, block_size=4, max_num_seqs=8, depth=1))
    driver.add(make_request("r", 6, max_tokens=3, n=3))
    states = [s.status for s in driver.core.requests["r"]]
    assert states == [SeqStatus.WAITING, SeqStatus.HELD, SeqStatus.HELD]
    driver.tick()  # sample 0's prompt is planned: the others join the queue or run
    assert all(s.status is not SeqStatus.HELD for s in driver.core.requests["r"])
    driver.run()
    driver.check_idle()


def test_the_stop_check() -> None:
    p = SamplingParams(max_tokens=5, min_tokens=2, stop_token_ids=[7])
    assert check_stop(p, EOS, 7, 2, 10, 100) is None  # min_tokens are not out yet
    assert check_stop(p, EOS, 7, 3, 10, 100) == Finish(FinishReason.STOP, 7)
    assert check_stop(p, EOS, 2, 3, 10, 100) == Finish(FinishReason.STOP)
    ignore = SamplingParams(ignore_eos=True)
    assert check_stop(ignore, EOS, 2, 3, 10, 100) is None
    assert check_stop(p, EOS, 9, 5, 10, 100) == Finish(FinishReason.LENGTH)  # max_tokens
    assert check_stop(ignore, EOS, 9, 5, 100, 100) == Finish(FinishReason.LENGTH)  # context
    assert reaches_length(p, 5, 10, 100) and not reaches_length(p, 4, 10, 100)
    assert suppressed_ids(p, EOS, 1) == [7, 2] and suppressed_ids(p, EOS, 2) == []
    assert suppressed_ids(SamplingParams(min_tokens=3, ignore_eos=True), EOS, 0) == []
