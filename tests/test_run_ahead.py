"""Issue 52's pieces that need no process: the --run-ahead-depth and --device timed syntax,
the auto depth's rule (stages/scheduler/pacing.py RunAheadDepth), and `bench overlap`'s chain
and predicted-idle arithmetic on a trace made by hand (pipeline/tools/bench_chain.py)."""

from __future__ import annotations

import math
from typing import Any

import pytest

from ipc.config import MAX_RUN_AHEAD_DEPTH, SchedulerConfig, parse_depth
from ipc.device import parse_device
from ipc.errors import ConfigError
from pipeline.cli import build_parser, run_ahead_depth
from pipeline.tools.bench_chain import chain_report, predicted_idle
from stages.scheduler.pacing import RunAheadDepth


def test_device_syntax_takes_an_optional_launch_cost() -> None:
    assert parse_device("timed:2,0") == ("cpu", (2.0, 0.0, 0.0))
    assert parse_device("timed:2,0.01,0.8") == ("cpu", (2.0, 0.01, 0.8))
    assert parse_device("cuda") == ("cuda:0", None)
    for bad in ("timed:2", "timed:2,0,1,4", "timed:2,-1", "timed:a,b", "timed:1,0,-0.5"):
        with pytest.raises(ConfigError, match=r"timed:A,B\[,S\]"):
            parse_device(bad)


def test_depth_syntax() -> None:
    assert parse_depth("auto") == "auto" and SchedulerConfig().depth == "auto"
    assert [parse_depth(str(d)) for d in range(1, MAX_RUN_AHEAD_DEPTH + 1)] == [1, 2, 3]
    for bad in ("0", "4", "two", ""):
        with pytest.raises(ConfigError, match="--run-ahead-depth must be auto or 1 to 3"):
            parse_depth(bad)
    with pytest.raises(ConfigError):
        SchedulerConfig(depth=5)


def _depth(*flags: str) -> Any:
    return run_ahead_depth(build_parser().parse_args(["generate", *flags, "--prompt", "x"]))


def test_the_cli_depth_and_no_overlap() -> None:
    assert _depth() == "auto"
    assert _depth("--run-ahead-depth", "3") == 3
    assert _depth("--no-overlap") == 1
    assert _depth("--no-overlap", "--run-ahead-depth", "1") == 1
    with pytest.raises(ConfigError, match="--no-overlap is --run-ahead-depth 1"):
        _depth("--no-overlap", "--run-ahead-depth", "2")


def test_auto_depth_goes_deep_only_behind_short_steps() -> None:
    auto = RunAheadDepth(3, short_ms=8.0)  # (round numbers: 8 and 10 ms)
    assert auto.depth == 2
    for _ in range(RunAheadDepth.MIN_SEEN - 1):  # not timed enough steps yet
        assert auto.observe(0.002) == 2
    assert auto.observe(0.002) == 3
    # A prefill now and then does not move the median; a run of long steps does.
    assert auto.observe(0.200) == 3
    for _ in range(RunAheadDepth.WINDOW):
        depth = auto.observe(0.050)
    assert depth == 2
    # Between the threshold and its hysteresis band the depth stays where it was.
    for _ in range(RunAheadDepth.WINDOW):
        assert auto.observe(0.009) == 2
    for _ in range(RunAheadDepth.WINDOW):
        depth = auto.observe(0.004)
    assert depth == 3
    for _ in range(RunAheadDepth.WINDOW):
        assert auto.observe(0.009) == 3
    assert RunAheadDepth(1, 8.0).observe(0.001) == 1  # never deeper than allowed


def test_predicted_idle_arithmetic() -> None:
    # depth 2, G = 2: chains of 1, 3 and 4 ms are late by 0, 1 and 2 ms: 3 of 6 + 3 ms
    assert predicted_idle([1.0, 3.0, 4.0], [2, 2, 2], 2.0) == pytest.approx(3 / 9)
    # depth 3 gives the same chains two steps: nothing late
    assert predicted_idle([1.0, 3.0, 4.0], [3, 3, 3], 2.0) == 0.0
    # synchronous: the whole chain is idle
    assert predicted_idle([1.0], [1], 2.0) == pytest.approx(1 / 3)
    assert math.isnan(predicted_idle([], [], 2.0))


def _span(name: str, step: int, ts: float, dur: float, **args: Any) -> dict[str, Any]:
    return {"ph": "X", "name": name, "ts": ts, "dur": dur, "args": {"step": step, **args}}


def test_chain_report_on_a_synthetic_trace() -> None:
    """Steps of 2 ms (µs in the trace) planned 2 deep; step m is launched 3.5 ms after step
    m - 2 ended (report 0.5, on_sampled 0.5, a gap of 0.1, schedule 0.9, 0.5 on the way,
    prepare 0.5, submit 0.5): L = 3.5 ms, half a step late at G = 3 ms."""
    trace: list[dict[str, Any]] = []
    for m in range(10):
        end = 2000.0 * (m + 1)  # step m on the device: [2000 m, 2000 (m + 1)]
        trace.append(_span("device", m, end - 2000, 2000, tokens=8, seqs=8))
        trace.append(_span("on_sampled", m, end + 500, 500))
        trace.append({"ph": "X", "name": "outputs", "ts": end + 2100, "dur": 300})
        nxt = m + 2  # the step this report lets the scheduler plan
        trace.append(_span("schedule", nxt, end + 1100, 900, depth=2))
        trace.append(_span("prepare", nxt, end + 2500, 500))
        trace.append(_span("submit", nxt, end + 3000, 500))
    report = chain_report(trace, steady_steps=list(range(2, 10)), default_depth=2)
    assert report.depth == 2 and len(report.chain_ms) == 8
    assert report.chain_ms == pytest.approx([3.5] * 8)
    parts = {k: v[0] for k, v in report.parts.items()}
    assert parts == pytest.approx({"report": 0.5, "on_sampled": 0.5, "to_schedule": 0.1,
                                   "schedule": 0.9, "to_executor": 0.5, "prepare": 0.5,
                                   "submit": 0.5})
    assert report.scheduler_ms == pytest.approx([0.5 + 0.9 + 0.3] * 8)
    assert report.executor_ms == pytest.approx([1.0] * 8)
    assert report.predicted(2.0) == pytest.approx(1.5 * 8 / (2 * 8 + 1.5 * 8))
    assert report.predicted(5.0) == 0.0
    summary = report.summary()
    assert summary["chain_p99_ms"] == pytest.approx(3.5)
    assert summary["predicted_idle_at_5ms"] == 0.0
