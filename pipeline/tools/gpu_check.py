"""The GPU check: what a machine with a CUDA GPU runs, once, in under 10 minutes, to prove the
CUDA path (scripts/gpu_check is its entry). Each part runs in a process of its own under its
own timeout, so one failure or hang loses only that part; the results go to one JSON file,
rewritten after every part.

Parts:
  versions     torch, CUDA, cuDNN, the GPU; the kernels each of our attention calls gets
  models       builds the random models the others use (kept in --work for a second run)
  overlap      run-ahead against synchronised-after-every-step, bit for bit (greedy, seeded
               sampling with penalties, min_tokens, logprobs, prompt logprobs, mixed lengths,
               preemption, chunked prefill), compiled with CUDA graphs and eager, and again
               with the GPU made slow so the host really runs ahead
  syncs        the same run with torch.cuda.set_sync_debug_mode("error"): no host sync
  utilisation  steady decode at batch 64 on a random 16-layer, 2048-wide bf16 Llama at ~300
               and ~3,000 tokens of context: kernels per step, GPU kernel time / wall (from
               the profiler's kernel intervals), host submit time per step, step time median
               and max; overlap against sync
  tests        the tests marked cuda
  bench        bench overlap on the 1B-shaped random model and the default one, batch 64 and
               256, run-ahead depth 2 and 3, and with n-gram drafts: measured device idle
               beside the idle the run-ahead chain predicts (pipeline/tools/bench_chain.py)

  python -m pipeline.tools.gpu_check --out results.json [--parts overlap,syncs] [--device cpu]

`--device cpu` runs the parts that make sense without CUDA (overlap), to test this file.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

from ipc.speculative import SpeculativeConfig

# Seconds each, at most: under 10 minutes in all.
PARTS = {"versions": 45, "models": 60, "overlap": 60, "syncs": 45, "tests": 120,
         "utilisation": 90, "bench": 170}
CUDA_ONLY = {"versions", "syncs", "utilisation", "tests", "bench"}
BIG_MODEL = {"layers": 16, "hidden": 2048, "heads": 16, "kv_heads": 8, "vocab_size": 32000}


def _model(folder: Path, big: bool) -> Path:
    from pipeline.tools.random_model import build_random_llama

    if (folder / "config.json").exists():
        return folder
    if big:
        return build_random_llama(folder, num_layers=BIG_MODEL["layers"],
                                  hidden=BIG_MODEL["hidden"], heads=BIG_MODEL["heads"],
                                  kv_heads=BIG_MODEL["kv_heads"],
                                  vocab_size=BIG_MODEL["vocab_size"], max_len=4096,
                                  weight_std=0.02)
    return build_random_llama(folder, num_layers=2, hidden=128, heads=4, kv_heads=2)


def _runner(model: Path, limits: Any, kv_bytes: int, device: str, compiled: bool,
            dtype: str = "float32") -> Any:
    import torch

    from stages.executor.runner import ModelRunner

    return ModelRunner.from_dir(str(model), getattr(torch, dtype), torch.device(device),
                                limits, kv_bytes, compile=compiled, graphs=compiled)


def small_limits(model: Path) -> Any:
    """4 slots and a 16-token budget (chunked prefill), pages of 16 (compiled CUDA needs a
    multiple of 16); SMALL_CACHE_BLOCKS of them make the overlap workload preempt."""
    from ipc.config import EngineLimits
    from ipc.model_info import ModelInfo

    info = ModelInfo.from_dir(model)
    return EngineLimits(max_num_seqs=4, max_num_batched_tokens=16, block_size=16,
                        max_model_len=256, vocab_size=info.vocab_size,
                        eos_token_ids=info.eos_token_ids, depth=2,
                        num_speculative_tokens=DRAFTS.num_tokens)


# The overlap part's run with drafts: 1-gram lookup proposes often on a random model's
# output (and its drafts seldom stand: the verification runs either way).
DRAFTS = SpeculativeConfig("ngram", 3, 2, 1)


SMALL_CACHE_BLOCKS = 5


def small_runner(model: Path, limits: Any, device: str, compiled: bool) -> Any:
    # (one block more: the compiled forward keeps one as scratch)
    return _runner(model, limits, (SMALL_CACHE_BLOCKS + 1) * _block_bytes(model, limits),
                   device, compiled)


# ---------------------------------------------------------------- parts


def part_versions(args: argparse.Namespace) -> dict[str, Any]:
    import torch
    import torch.nn.functional as F

    from stages.executor.backends.torch_sdpa import decode_attention

    dev = torch.device("cuda")
    out: dict[str, Any] = {
        "torch": torch.__version__, "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version(), "gpu": torch.cuda.get_device_name(),
        "capability": list(torch.cuda.get_device_capability()),
        "sdp_enabled": {"flash": torch.backends.cuda.flash_sdp_enabled(),
                        "mem_efficient": torch.backends.cuda.mem_efficient_sdp_enabled(),
                        "cudnn": torch.backends.cuda.cudnn_sdp_enabled(),
                        "math": torch.backends.cuda.math_sdp_enabled()}}
    bf, fp = torch.bfloat16, torch.float32
    h, kvh, d, b, length = 16, 8, 128, 64, 512

    def rand(*shape: int, dtype: torch.dtype = bf) -> torch.Tensor:
        return torch.randn(*shape, device=dev, dtype=dtype)

    mask = torch.ones(b, 1, 1, length, dtype=torch.bool, device=dev)
    calls = {
        # paged_attention, eager: decode rows in fp32 (SDPA with a padding mask)
        "eager decode fp32 (SDPA, mask)": lambda: F.scaled_dot_product_attention(
            rand(b, h, 1, d, dtype=fp), rand(b, kvh, length, d, dtype=fp),
            rand(b, kvh, length, d, dtype=fp), attn_mask=mask, enable_gqa=True),
        # ... and in bf16 (two matrix products)
        "eager decode bf16 (decode_attention)": lambda: decode_attention(
            rand(b, h, d), rand(b, kvh, length, d), rand(b, kvh, length, d), mask, d**-0.5),
        "eager prefill, no past (SDPA causal)": lambda: F.scaled_dot_product_attention(
            rand(1, h, 1024, d), rand(1, kvh, 1024, d), rand(1, kvh, 1024, d),
            is_causal=True, enable_gqa=True),
        "eager prefill with past (SDPA, mask)": lambda: F.scaled_dot_product_attention(
            rand(1, h, 256, d), rand(1, kvh, 1024, d), rand(1, kvh, 1024, d),
            attn_mask=torch.ones(1, 1, 256, 1024, dtype=torch.bool, device=dev).tril(768),
            enable_gqa=True),
        "compiled (flex_paged_attention)": _lazy(lambda: _flex_call(dev, h, kvh, d)),
    }
    out["attention_kernels"] = {}
    for name, call in calls.items():
        try:
            out["attention_kernels"][name] = _kernel_names(call)
        except Exception as exc:  # one call failing keeps the others' answers
            out["attention_kernels"][name] = f"failed: {type(exc).__name__}: {exc}"[:1500]
    out["ok"] = all(isinstance(v, list) for v in out["attention_kernels"].values())
    return out


def _lazy(make: Any) -> Any:
    """A call built on its first use (so that building it fails inside its own try)."""
    made: list[Any] = []

    def call() -> Any:
        if not made:
            made.append(make())
        return made[0]()

    return call


def _flex_call(dev: Any, heads: int, kv_heads: int, head_dim: int) -> Any:
    import torch

    from stages.executor.backends.flex import build_flex_metadata, flex_paged_attention

    bs, num_blocks, seqs = 16, 256, 8
    table = torch.arange(seqs * 16, device=dev, dtype=torch.int32).view(seqs, 16)
    positions = torch.full((seqs,), 100, device=dev, dtype=torch.int64)  # one decode each
    v = {"positions": positions, "token_slots": torch.arange(seqs, device=dev),
         "query_rows": torch.arange(seqs, device=dev) * bs + 100 % bs,
         "qblock_slots": torch.arange(seqs, device=dev),
         "qblock_pages": torch.full((seqs,), 100 // bs, device=dev, dtype=torch.int64)}
    cache = torch.randn(2, num_blocks, bs, kv_heads, head_dim, device=dev, dtype=torch.bfloat16)
    fn = torch.compile(flex_paged_attention, fullgraph=True, dynamic=False)

    def call() -> Any:
        meta = build_flex_metadata(v, table, bs, num_blocks)
        q = torch.randn(seqs, heads, head_dim, device=dev, dtype=torch.bfloat16)
        k = torch.randn(seqs, kv_heads, head_dim, device=dev, dtype=torch.bfloat16)
        return fn(q, k, k.clone(), cache, meta, head_dim**-0.5)

    call()  # compile outside the profile
    return call


def _kernel_names(call: Any) -> list[str]:
    import torch
    from torch.profiler import ProfilerActivity, profile

    call()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        call()
        torch.cuda.synchronize()
    names = [e.name for e in prof.events() if _is_kernel(e)]
    return sorted(set(names))


def _is_kernel(event: Any) -> bool:
    from torch.autograd import DeviceType

    return bool(event.device_type == DeviceType.CUDA and not event.name.startswith("Memcpy")
                and not event.name.startswith("Memset"))


def part_models(args: argparse.Namespace) -> dict[str, Any]:
    small = _model(Path(args.work) / "small", big=False)
    big = _model(Path(args.work) / "big", big=True) if args.device == "cuda" else None
    return {"ok": True, "small": str(small), "big": str(big)}


def part_overlap(args: argparse.Namespace, slow: bool = True) -> dict[str, Any]:
    from pipeline.tools.device_run import DeviceRun, comparable, overlap_workload, same_tokens

    model = _model(Path(args.work) / "small", big=False)
    limits = small_limits(model)
    out: dict[str, Any] = {}
    modes = {"compiled+graphs": True, "eager": False} if args.device == "cuda" else {
        "eager": False}
    for mode, compiled in modes.items():
        runner = small_runner(model, limits, args.device, compiled)
        run = DeviceRun(runner, limits)
        requests = overlap_workload(limits.vocab_size)
        start = time.perf_counter()
        # A first run compiles and captures: the compared runs then take the same paths.
        run.run(requests)
        ahead, stats = run.run(requests)
        synced, _ = run.run(requests, sync=True)
        drafted, drafted_stats = run.run(requests, speculative=DRAFTS)
        result: dict[str, Any] = {"equal": comparable(ahead) == comparable(synced),
                                  # the tokens: a drafted position's logits come from a
                                  # longer row, so their last bits may differ
                                  "equal_with_drafts": same_tokens(drafted, synced),
                                  "steps_with_drafts": drafted_stats.steps,
                                  "drafts": [drafted_stats.draft_tokens,
                                             drafted_stats.accepted_tokens],
                                  "steps": stats.steps, "preemptions": stats.preemptions,
                                  "tokens": sum(len(r.token_ids) for r in ahead.values())}
        if slow and args.device == "cuda":
            slowed, _ = run.run(requests, slow_cycles=args.slow_cycles)
            result["equal_with_slow_gpu"] = comparable(slowed) == comparable(synced)
        graphs = getattr(runner, "graphs", None)
        if graphs is not None:
            result["graphs"] = {"captures": graphs.stats.captures,
                                "replays": graphs.stats.replays,
                                "failed": graphs.stats.failed}
        result["seconds"] = round(time.perf_counter() - start, 2)
        out[mode] = result
    out["ok"] = all(r["equal"] and r["equal_with_drafts"] and r.get("equal_with_slow_gpu", True)
                    and not r.get("graphs", {}).get("failed")
                    for r in out.values() if isinstance(r, dict))
    return out


def _block_bytes(model: Path, limits: Any) -> int:
    cfg = json.loads((model / "config.json").read_text())
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    return (cfg["num_hidden_layers"] * 2 * limits.block_size * cfg["num_key_value_heads"]
            * head_dim * 4)


def part_syncs(args: argparse.Namespace) -> dict[str, Any]:
    """A warm run compiles and captures; the second runs with any host sync an error (it is
    a process-wide mode: the notifier's and grammar thread's waits are events, which it
    does not count)."""
    import torch

    from pipeline.tools.device_run import DeviceRun, overlap_workload

    model = _model(Path(args.work) / "small", big=False)
    limits = small_limits(model)
    out: dict[str, Any] = {}
    for mode, compiled in {"compiled+graphs": True, "eager": False}.items():
        run = DeviceRun(small_runner(model, limits, "cuda", compiled), limits)
        requests = overlap_workload(limits.vocab_size)
        run.run(requests)
        torch.cuda.set_sync_debug_mode("error")
        try:
            run.run(requests)
            out[mode] = {"host_syncs": 0}
        except Exception as exc:  # the first sync, with where it happened
            out[mode] = {"host_syncs": ">= 1", "first": "".join(
                traceback.format_exception(exc))[-3000:]}
        finally:
            torch.cuda.set_sync_debug_mode(0)
    out["ok"] = all(r.get("host_syncs") == 0 for r in out.values() if isinstance(r, dict))
    return out


def part_utilisation(args: argparse.Namespace) -> dict[str, Any]:
    from ipc.config import EngineLimits
    from ipc.messages import SamplingParams
    from ipc.model_info import ModelInfo
    from pipeline.tools.device_run import DeviceRun

    model = _model(Path(args.work) / "big", big=True)
    info = ModelInfo.from_dir(model)
    batch, active = 64, 24
    out: dict[str, Any] = {"model": BIG_MODEL, "dtype": "bfloat16", "batch": batch}
    # A 512-token budget: prefill steps of one bucket, decode steps of one (64).
    limits = EngineLimits(max_num_seqs=batch, max_num_batched_tokens=512, block_size=16,
                          max_model_len=4096, vocab_size=info.vocab_size, depth=2)
    runner = _runner(model, limits, 24 << 30, "cuda", compiled=True, dtype="bfloat16")
    run = DeviceRun(runner, limits)
    for context in (300, 3000):
        prompts = [[(11 + 7 * i + 13 * j) % (info.vocab_size - 10) + 5 for j in range(context)]
                   for i in range(batch)]

        def requests(max_tokens: int, prompts: list[list[int]] = prompts) -> Any:
            params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
            return [(f"u{i}", p, params) for i, p in enumerate(prompts)]

        run.run(requests(4))  # compiles every bucket this workload meets, captures decode's
        # Every prompt is prefilled before the window opens, and chunked prefill lets the
        # first ones decode meanwhile: they must outlive the last prompt's prefill steps.
        prefill_steps = -(-batch * context // limits.max_num_batched_tokens) + 1
        for mode, sync in (("overlap", False), ("sync", True)):
            window = ProfileWindow(batch, skip=4, active=active)
            _, stats = run.run(requests(prefill_steps + 4 + ProfileWindow.WARMUP + active + 4),
                               sync=sync, before_submit=window.before_submit)
            window.finish()
            out[f"ctx{context}_{mode}"] = window.report(stats)
    graphs = runner.graphs
    out["graphs"] = {"captures": graphs.stats.captures, "buckets": graphs.stats.buckets,
                     "failed": graphs.stats.failed}
    out["compiled_graphs"] = runner.compile_stats.num_graphs
    return out


def kernel_busy(intervals: list[tuple[float, float]]) -> tuple[float, float]:
    """(time some kernel ran, first start to last end) of kernel intervals: the union, so
    kernels overlapping on several streams count once."""
    busy, last_end = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end > last_end:
            busy += end - max(start, last_end)
            last_end = end
    wall = max(e for _, e in intervals) - min(s for s, _ in intervals) if intervals else 0.0
    return busy, wall


class ProfileWindow:
    """The device's kernels over `active` steady decode steps (every sequence decoding),
    after `skip` of them and WARMUP more under a warming profiler (CUPTI starts then, not
    inside the measured steps). Kernel intervals come from the profiler; step times and
    submit times from the run's own records of the same steps."""

    WARMUP = 3

    def __init__(self, batch: int, skip: int, active: int) -> None:
        self.batch, self.skip, self.active = batch, skip, active
        self.seen, self.submitted = 0, 0
        self.indices: list[int] = []  # submit indices of the measured steps
        self.kernels: list[tuple[float, float]] | None = None
        self.prof: Any = None

    def before_submit(self, step: Any) -> None:
        import torch
        from torch.profiler import ProfilerActivity, profile, schedule

        index, self.submitted = self.submitted, self.submitted + 1
        if self.kernels is not None:
            return
        if not (step.decode_only and step.plan.num_seqs == self.batch):
            self.finish()
            return
        self.seen += 1
        k = self.seen - self.skip - 1  # this step's place in the window
        if k < 0:
            return
        if k == 0:
            self.prof = profile(activities=[ProfilerActivity.CUDA],
                                schedule=schedule(wait=0, warmup=self.WARMUP,
                                                  active=self.active, repeat=1),
                                on_trace_ready=self._ready)
            self.prof.start()
            return
        if k == self.WARMUP + self.active:
            torch.cuda.synchronize()  # the measured steps' kernels are all in the trace
        self.prof.step()
        if k < self.WARMUP + self.active and k >= self.WARMUP:
            self.indices.append(index)
        if k >= self.WARMUP + self.active:
            self.finish()

    def _ready(self, prof: Any) -> None:
        self.kernels = [(e.time_range.start, e.time_range.end) for e in prof.events()
                        if _is_kernel(e)]

    def finish(self) -> None:
        if self.prof is not None:
            self.prof.stop()
            self.prof = None

    def report(self, stats: Any) -> dict[str, Any]:
        if not self.kernels or len(self.indices) < 2:
            return {"error": f"the window saw {len(self.indices)} steady steps"}
        busy, wall = kernel_busy(self.kernels)
        n = len(self.indices)
        submit = [stats.submit_ns[i] / 1e6 for i in self.indices]
        ends = [stats.device[i][2] for i in self.indices]
        walls = [(b - a) / 1e6 for a, b in zip(ends, ends[1:], strict=False)]
        return {"steps_measured": n,
                "kernels_per_step": round(len(self.kernels) / n, 1),
                "gpu_kernel_time_over_wall": round(busy / wall, 4),
                "gpu_idle": round(1 - busy / wall, 4),
                "host_submit_ms_median": round(statistics.median(submit), 3),
                "step_ms_median": round(statistics.median(walls), 3),
                "step_ms_max": round(max(walls), 3),
                "note": "under the profiler (CUPTI adds host time to each launch)"}


def part_tests(args: argparse.Namespace) -> dict[str, Any]:
    """The tests marked cuda, each named with its time (what ran survives a timeout)."""
    cmd = [sys.executable, "-m", "pytest", "tests/test_cuda.py", "-m", "cuda", "-v",
           "--durations=0", "-p", "no:cacheprovider", "-p", "no:logging", "--timeout", "90"]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=PARTS["tests"] - 10)
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout or ""
        return {"ok": False, "error": f"timed out after {PARTS['tests'] - 10} s",
                "tail": (out.decode(errors="replace") if isinstance(out, bytes) else out)[-3000:]}
    return {"ok": proc.returncode == 0, "tail": (proc.stdout + proc.stderr)[-3000:]}


# bench's rows: (model, batch, run-ahead depth, speculative), each `bench overlap` (sync
# against that depth) with the chain's predicted idle beside the measured one.
BENCH_ROWS = [(model, batch, depth, None) for model in ("big", "default") for batch in (64, 256)
              for depth in (2, 3)] + [("big", 64, 3, "ngram:3"), ("default", 64, 3, "ngram:3")]


def part_bench(args: argparse.Namespace) -> dict[str, Any]:
    """bench overlap on the 1B shape and the default model, batch 64 and 256, run-ahead depth
    2 and 3, and with n-gram drafts: measured idle, predicted idle, the chain's parts."""
    rows = []
    deadline = time.monotonic() + PARTS["bench"] - 15
    for model_kind, batch, depth, spec in BENCH_ROWS:
        left = deadline - time.monotonic()
        if left < 10:
            rows.append({"model": model_kind, "batch": batch, "depth": depth,
                         "speculative": spec, "skipped": "out of the part's time"})
            continue
        model = ["--model", str(_model(Path(args.work) / "big", big=True))
                 ] if model_kind == "big" else []
        out_json = Path(args.work) / f"overlap-{model_kind}-{batch}-{depth}-{spec}.json"
        cmd = [sys.executable, "-m", "pipeline.tools.bench", "overlap", "--device", "cuda",
               "--dtype", "bfloat16", *model, "--batch", str(batch),
               "--output-len", "64", "--repeat", "1", "--kv-cache-memory", "16GiB",
               "--run-ahead-depth", str(depth), "--json", str(out_json)]
        cmd += ["--speculative", spec] if spec else []
        row: dict[str, Any] = {"model": model_kind, "batch": batch, "depth": depth,
                               "speculative": spec}
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=left)
        except subprocess.TimeoutExpired:
            rows.append({**row, "ok": False, "error": f"timed out after {left:.0f} s"})
            continue
        report = json.loads(out_json.read_text()) if out_json.exists() else None
        row["ok"] = proc.returncode == 0 and report is not None
        if report is not None:
            row.update(idle=report["async"]["device_idle_frac"],
                       sync_idle=report["sync"]["device_idle_frac"],
                       step_ms=report["async"]["mean_step_ms"],
                       submit_ms=report["async"]["host_submit_ms"],
                       chain=report["chain"]["async"],
                       identical=report["identical_outputs"])
        else:
            row["tail"] = (proc.stdout + proc.stderr)[-2000:]
        rows.append(row)
    return {"ok": all(r.get("ok", True) for r in rows), "rows": rows}


# ---------------------------------------------------------------- the driver


def _run_part(name: str, args: argparse.Namespace) -> dict[str, Any]:
    """The part `name` in a process of its own under its timeout."""
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        result_path = f.name
    cmd = [sys.executable, "-m", "pipeline.tools.gpu_check", "--part", name,
           "--result", result_path, "--work", args.work, "--device", args.device,
           "--slow-cycles", str(args.slow_cycles)]
    start = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=PARTS[name])
        if proc.returncode != 0 or not os.path.getsize(result_path):
            result = {"ok": False, "error": f"exit {proc.returncode}",
                      "tail": (proc.stdout + proc.stderr)[-3000:]}
        else:
            result = json.loads(Path(result_path).read_text())
    except subprocess.TimeoutExpired as exc:
        tail = ((exc.stdout or b"") + (exc.stderr or b""))
        result = {"ok": False, "error": f"timed out after {PARTS[name]} s",
                  "tail": tail.decode(errors="replace")[-3000:] if isinstance(tail, bytes)
                  else str(tail)[-3000:]}
    finally:
        os.unlink(result_path)
    result["seconds"] = round(time.perf_counter() - start, 1)
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="gpu_check", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="gpu_check.json", help="the results (JSON)")
    p.add_argument("--parts", default=",".join(PARTS), help="comma-separated, in order")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--work", default=os.path.join(tempfile.gettempdir(), "llmp-gpu-check"),
                   help="where the random models are built (kept for a second run)")
    p.add_argument("--slow-cycles", type=int, default=2_000_000,
                   help="torch.cuda._sleep per stream and step in the slow-GPU run")
    p.add_argument("--part", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    os.makedirs(args.work, exist_ok=True)
    if args.part:  # one part, in this process
        import torch

        torch.manual_seed(0)
        fn = globals()[f"part_{args.part}"]
        result = fn(args)
        Path(args.result).write_text(json.dumps(result, indent=2, default=str))
        return 0
    results: dict[str, Any] = {"started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                               "device": args.device}
    for name in args.parts.split(","):
        if name not in PARTS:
            p.error(f"--parts: unknown part {name!r} (known: {', '.join(PARTS)})")
        if args.device != "cuda" and name in CUDA_ONLY:
            results[name] = {"skipped": "needs CUDA"}
        else:
            print(f"gpu_check: {name} (at most {PARTS[name]} s)", flush=True)
            results[name] = _run_part(name, args)
            print(f"gpu_check: {name}: ok={results[name].get('ok', '-')} "
                  f"in {results[name]['seconds']} s", flush=True)
        Path(args.out).write_text(json.dumps(results, indent=2, default=str))
    failed = [n for n, r in results.items() if isinstance(r, dict) and r.get("ok") is False]
    print(f"gpu_check: results in {args.out}; failed: {', '.join(failed) or 'none'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
