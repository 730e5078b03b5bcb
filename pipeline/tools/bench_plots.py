"""PNG plots of the benchmarks (matplotlib, headless). Runs in the benchmark process."""

from __future__ import annotations

import os
from typing import Any


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_timeline(rows: list[tuple[str, list[tuple[float, float]], str]], path: str,
                  title: str) -> str:
    """Device busy intervals, one row per run (label, spans in s, caption); gaps are idle."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(12, 1.4 + 0.7 * len(rows)))
    palette = [("tab:orange", "navajowhite"), ("tab:blue", "lightsteelblue")]
    for row, (_, spans, caption) in enumerate(rows):
        colors = palette[row % 2]
        ax.broken_barh([(a * 1e3, (b - a) * 1e3) for a, b in spans[:40]], (row - 0.35, 0.7),
                       facecolors=[colors[i % 2] for i in range(min(40, len(spans)))])
        ax.text(0, row + 0.42, caption, fontsize=8)
    ax.set_yticks(range(len(rows)), [r[0] for r in rows])
    ax.set_xlabel("ms since the first steady step (device busy intervals; gaps = idle)")
    ax.set_title(title, fontsize=9)
    return _save(plt, fig, path)


def plot_throughput_vs_batch(by_batch: dict[int, dict[str, float]], out_dir: str) -> str:
    """Output tok/s of each engine against the batch size."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.5, 4))
    sizes = sorted(by_batch)
    for engine in by_batch[sizes[0]]:
        ax.plot(sizes, [by_batch[b][engine] for b in sizes], marker="o", label=engine)
    ax.set_xscale("log", base=2)
    ax.set_xticks(sizes, [str(b) for b in sizes])
    _label(ax, "batch size (max sequences per step)", "output tokens / s",
           "throughput by engine and batch size")
    return _save(plt, fig, os.path.join(out_dir, "throughput_vs_batch.png"))


def _label(ax: Any, xlabel: str, ylabel: str, title: str) -> None:
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)


def _save(plt: Any, fig: Any, path: str) -> str:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_latency_vs_rate(summaries: list[dict[str, Any]], out_dir: str) -> str:
    """TTFT, TPOT and end-to-end latency percentiles against the request rate."""
    plt = _pyplot()
    os.makedirs(out_dir, exist_ok=True)
    rates = [s["request_rate"] for s in summaries]
    finite = [r for r in rates if r != float("inf")]
    xs = [r if r != float("inf") else (max(finite, default=1) * 2) for r in rates]
    labels = [str(r) if r != float("inf") else "inf" for r in rates]
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    for ax, key, title in zip(axes, ("ttft_ms", "tpot_ms", "e2e_ms"),
                              ("time to first token", "time per output token",
                               "end-to-end latency"), strict=True):
        for pct in ("p50", "p90", "p99"):
            ax.plot(xs, [s[key][pct] for s in summaries], marker="o", label=pct)
        ax.set_xticks(xs, labels)
        _label(ax, "request rate (req/s)", "ms", title)
    return _save(plt, fig, os.path.join(out_dir, "latency_vs_rate.png"))
