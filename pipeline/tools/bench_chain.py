"""The run-ahead chain of `bench overlap`, read from a run's merged trace (stages/trace.py):
with `depth` steps in flight, step N + depth is planned only once step N's tokens are in, so
everything from the end of step N on the device to the launch of step N + depth (the
executor's report, the scheduler's on_sampled and schedule, the plan's way to the executor,
its prepare and submit) must fit in depth - 1 device steps. This measures that chain, L, per
steady step and predicts the idle a device of G ms a step would see at the run's depth:
Σ max(0, L − (depth − 1)·G) ÷ (n·G + that sum) over the n steady steps. (Each step's late
launch delays the device by at most its excess over the steps still queued; the figure
ignores that a late step also delays the chain behind it, so it errs low where L keeps
exceeding the queue, and the measured idle of a timed device of that G is the check.)"""

from __future__ import annotations

import bisect
import statistics
from dataclasses import dataclass, field
from typing import Any

import numpy as np

PREDICT_AT_MS = (2.0, 5.0)  # the device steps the predicted idle is reported for


def predicted_idle(chain_ms: list[float], depths: list[int], step_ms: float) -> float:
    """The device's idle share behind chains of chain_ms (each step's at its own depth),
    were each device step step_ms long."""
    late = sum(max(0.0, c - (d - 1) * step_ms) for c, d in zip(chain_ms, depths, strict=True))
    total = len(chain_ms) * step_ms + late
    return late / total if total else float("nan")


def percentiles(values: list[float]) -> tuple[float, float]:
    """(p50, p99), or NaN for none."""
    if not values:
        return float("nan"), float("nan")
    p50, p99 = np.percentile(values, [50, 99])
    return float(p50), float(p99)


@dataclass
class ChainReport:
    """Per steady step, in ms: the chain and its parts, and each stage's host time."""

    depth: float = float("nan")  # the median depth the steady steps were planned at
    chain_ms: list[float] = field(default_factory=list)  # L of each steady step
    depths: list[int] = field(default_factory=list)
    parts: dict[str, list[float]] = field(default_factory=dict)  # the chain's parts
    scheduler_ms: list[float] = field(default_factory=list)  # on_sampled + schedule + outputs
    executor_ms: list[float] = field(default_factory=list)  # prepare + submit

    def predicted(self, step_ms: float) -> float:
        return predicted_idle(self.chain_ms, self.depths, step_ms)

    def summary(self) -> dict[str, Any]:
        out: dict[str, Any] = {"depth": self.depth, "steps": len(self.chain_ms)}
        for name, values in (("chain", self.chain_ms), *self.parts.items(),
                             ("scheduler", self.scheduler_ms), ("executor", self.executor_ms)):
            out[f"{name}_p50_ms"], out[f"{name}_p99_ms"] = percentiles(values)
        for g in PREDICT_AT_MS:
            out[f"predicted_idle_at_{g:g}ms"] = self.predicted(g)
        return out


def _by_step(trace: list[dict[str, Any]], name: str) -> dict[int, dict[str, Any]]:
    return {e["args"]["step"]: e for e in trace
            if e.get("name") == name and e.get("ph") == "X" and "step" in e.get("args", {})}


def _end(e: dict[str, Any]) -> float:
    return float(e["ts"] + e["dur"])


def chain_report(trace: list[dict[str, Any]], steady_steps: list[int],
                 default_depth: int) -> ChainReport:
    """The chain of each steady step M (planned at depth d, from its schedule span's args;
    default_depth for a trace without it): L = launch(M) − end(M − d) on the device, where the
    launch is the end of the executor's submit. Times in the trace are µs."""
    device, submit = _by_step(trace, "device"), _by_step(trace, "submit")
    prepare, schedule = _by_step(trace, "prepare"), _by_step(trace, "schedule")
    sampled = _by_step(trace, "on_sampled")
    outputs = sorted((e for e in trace if e.get("name") == "outputs" and e.get("ph") == "X"),
                     key=lambda e: e["ts"])
    outputs_ts = [e["ts"] for e in outputs]
    report = ChainReport(parts={k: [] for k in ("report", "on_sampled", "to_schedule",
                                                "schedule", "to_executor", "prepare",
                                                "submit")})
    for m in steady_steps:
        sched = schedule.get(m)
        d = int(sched["args"].get("depth", default_depth)) if sched else default_depth
        n = m - d
        if n not in device or m not in submit or n not in sampled or sched is None \
                or m not in prepare:
            continue
        end_n, took = _end(device[n]), sampled[n]
        report.chain_ms.append((_end(submit[m]) - end_n) / 1e3)
        report.depths.append(d)
        for key, value in (("report", took["ts"] - end_n), ("on_sampled", took["dur"]),
                           ("to_schedule", sched["ts"] - _end(took)),
                           ("schedule", sched["dur"]),
                           ("to_executor", prepare[m]["ts"] - _end(sched)),
                           ("prepare", prepare[m]["dur"]), ("submit", submit[m]["dur"])):
            report.parts[key].append(value / 1e3)
    for m in steady_steps:
        if m in sampled and m in schedule:
            took = sampled[m]  # the outputs flushed after the loop that took step m's ids
            i = bisect.bisect_left(outputs_ts, _end(took))
            flushed = outputs[i]["dur"] if i < len(outputs) else 0.0
            report.scheduler_ms.append((took["dur"] + schedule[m]["dur"] + flushed) / 1e3)
        if m in prepare and m in submit:
            report.executor_ms.append((prepare[m]["dur"] + submit[m]["dur"]) / 1e3)
    report.depth = statistics.median(report.depths) if report.depths else float("nan")
    return report


def print_chain(report: ChainReport, label: str) -> None:
    """The chain's parts and the stages' host time (p50 / p99 ms), and the predicted idle."""
    s = report.summary()
    print(f"run-ahead chain, {label} (depth {report.depth:g}, {len(report.chain_ms)} steady "
          f"steps; ms p50 / p99):")
    names = ["chain", *report.parts, "scheduler", "executor"]
    print("  " + "  ".join(f"{n} {s[f'{n}_p50_ms']:.3f}/{s[f'{n}_p99_ms']:.3f}"
                           for n in names))
    print("  predicted device idle: " + ", ".join(
        f"{s[f'predicted_idle_at_{g:g}ms']:.2%} at G = {g:g} ms" for g in PREDICT_AT_MS))
