"""The benchmarks: workloads are deterministic and follow their documented laws; latency
metrics are computed exactly; each benchmark runs end to end on the tiny model and writes the
JSON its contract names, with identical greedy outputs where they must be identical."""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import pytest
from tiny_model import build_tiny_llama

from pipeline.tools import bench
from pipeline.tools.bench_serve import RequestRecord, arrival_times, summarize
from pipeline.tools.datasets import random_prompts, synthetic_chat
from stages.executor.linear.quantized import kernel_missing

pytestmark = pytest.mark.timeout(300)


def test_synthetic_chat_is_deterministic_and_long_tailed() -> None:
    a, b = synthetic_chat(2000, seed=3), synthetic_chat(2000, seed=3)
    assert a == b and a != synthetic_chat(2000, seed=4)
    ins = [s.target_input_tokens for s in a]
    outs = [s.output_tokens for s in a]
    assert min(ins) >= 16 and max(ins) <= 2048 and min(outs) >= 16 and max(outs) <= 512
    assert 90 <= statistics.median(ins) <= 150 and 80 <= statistics.median(outs) <= 125
    assert sorted(ins)[int(0.9 * len(ins))] > 3 * statistics.median(ins)  # a long tail


def test_random_prompts_stay_in_the_vocabulary() -> None:
    prompts = random_prompts(10, 7, vocab_size=300, seed=1)
    assert len(prompts) == 10 and all(len(p) == 7 for p in prompts)
    assert all(100 <= t < 300 for p in prompts for t in p)


def test_poisson_arrivals() -> None:
    assert arrival_times(5, float("inf"), 0) == [0.0] * 5
    times = arrival_times(4000, 8.0, 0)
    gaps = [b - a for a, b in zip([0.0, *times[:-1]], times, strict=True)]
    assert all(g > 0 for g in gaps) and abs(statistics.mean(gaps) - 1 / 8) < 0.01


def test_latency_metrics_are_exact() -> None:
    records = [RequestRecord(0.0, [0.1, 0.2, 0.3], 5), RequestRecord(1.0, [1.5, 1.9], 7),
               RequestRecord(2.0, [], 3, "the prompt is empty")]
    args = type("A", (), {"request_rate": 2.0, "max_concurrency": None,
                          "slo_ttft_ms": 200.0, "slo_tpot_ms": 500.0})()
    s = summarize(records, 2.0, args)  # type: ignore[arg-type]
    assert s["completed"] == 2 and s["failed"] == 1 and s["errors"] == ["the prompt is empty"]
    assert s["ttft_ms"]["mean"] == pytest.approx(300.0)  # 100 and 500 ms
    assert s["tpot_ms"]["mean"] == pytest.approx(250.0)  # 100 and 400 ms
    assert s["itl_ms"]["p50"] == pytest.approx(100.0)  # 100, 100, 400 ms
    assert s["e2e_ms"]["mean"] == pytest.approx(600.0)  # 300 and 900 ms
    assert s["output_token_throughput"] == pytest.approx(2.5)
    assert s["goodput"]["requests_per_s"] == pytest.approx(0.5)  # only the first meets TTFT


@pytest.mark.live
def test_throughput_benchmark_end_to_end(tiny_model_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "t.json"
    rc = bench.main(["throughput", "--model", str(tiny_model_dir), "--num-prompts", "6",
                     "--batch-size", "2,3", "--input-len", "5", "--output-len", "7",
                     "--peers", "hf-static", "--json", str(out), "--plot", str(tmp_path),
                     "--speculative", "ngram:2:2:1"]
                    + (["--quantization", "int8"] if kernel_missing() is None else []))
    report = json.loads(out.read_text())
    assert rc == 0 and {"pipeline", "hf-static", "limit", "ratios", "config"} <= set(report)
    assert report["config"]["speculative"] == "ngram:2:2:1"
    for engine in ("pipeline", "pipeline-spec", "hf-static", "limit"):
        assert report[engine]["output_tokens"] == 6 * 7
        assert report[engine]["identical_to_pipeline"] == 6  # greedy, fp32, the same model
        assert report[engine]["output_tok_s"] > 0 and report[engine]["seconds"] > 0
    quantized = {"pipeline-int8", "limit-int8"} if kernel_missing() is None else set()
    for engine in quantized:  # the quantized rows: the same work, their own tokens
        assert report[engine]["output_tokens"] == 6 * 7 and report[engine]["output_tok_s"] > 0
    if quantized:  # the pipeline and the limit run the same quantized model
        assert report["pipeline-int8"]["identical_to_pipeline"] == \
            report["limit-int8"]["identical_to_pipeline"]
    assert set(report["ratios"]) == {"pipeline/hf-static", "pipeline/limit",
                                     "pipeline/pipeline-spec",
                                     *(f"pipeline/{e}" for e in quantized)}
    assert sorted(report["by_batch_size"]) == ["2", "3"]
    assert (tmp_path / "throughput_vs_batch.png").stat().st_size > 1000


@pytest.mark.live
def test_quality_benchmark_end_to_end(tiny_model_dir: Path, tmp_path: Path) -> None:
    if kernel_missing() is not None:
        pytest.skip(f"quantized kernels: {kernel_missing()}")
    out = tmp_path / "q.json"
    rc = bench.main(["quality", "--model", str(tiny_model_dir), "--quantization", "int8,int4",
                     "--kv-cache-dtype", "int8,fp8_e5m2", "--output-len", "6",
                     "--json", str(out)])
    report = json.loads(out.read_text())
    assert rc == 0 and report["config"]["prompts"] == 16 and report["config"]["text_tokens"] > 50
    for name in ("int8", "int4", "kv int8", "kv fp8_e5m2"):
        r = report[name]
        assert 0 < r["mean_abs_dlogprob"] <= r["max_abs_dlogprob"] and r["mean_abs_dlogprob"] < 1
        assert 0 <= r["greedy_identical"] <= 16 and 0 <= r["mean_shared_prefix"] <= 6
    # 4-bit codes round the tiny model's random weights more than 8-bit ones
    assert report["int4"]["mean_abs_dlogprob"] > report["int8"]["mean_abs_dlogprob"]
    # and e5m2's 2 mantissa bits a key more than int8's codes with a scale per token
    assert report["kv fp8_e5m2"]["mean_abs_dlogprob"] > report["kv int8"]["mean_abs_dlogprob"]
    assert "floor" not in report  # (float32 activations: the reference is exact enough)
    # bf16 activations: the floor row, the reference through PyTorch's ops instead
    rc = bench.main(["quality", "--model", str(tiny_model_dir), "--quantization", "",
                     "--kv-cache-dtype", "int8", "--output-len", "4", "--dtype", "bfloat16",
                     "--json", str(out)])
    report = json.loads(out.read_text())
    assert rc == 0 and set(report) == {"config", "float32 weights", "kv int8", "floor"}
    assert 0 <= report["floor"]["mean_abs_dlogprob"] <= report["floor"]["max_abs_dlogprob"] < 1
    with pytest.raises(SystemExit, match="unknown formats"):
        bench.main(["quality", "--model", str(tiny_model_dir), "--quantization", "fp8"])
    with pytest.raises(SystemExit, match="unknown KV cache formats"):
        bench.main(["quality", "--model", str(tiny_model_dir), "--kv-cache-dtype", "q4_0"])


def test_overlap_outputs_may_differ_only_where_cuda_batched_differently() -> None:
    assert not bench.outputs_differ_by_fault(True, False, "cpu")
    assert bench.outputs_differ_by_fault(False, False, "cpu")
    assert bench.outputs_differ_by_fault(False, True, "cuda")
    assert not bench.outputs_differ_by_fault(False, False, "cuda:0")


@pytest.mark.live
def test_overlap_benchmark_end_to_end(tiny_model_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "o.json"
    rc = bench.main(["overlap", "--model", str(tiny_model_dir), "--device", "timed:1,0",
                     "--batch", "4", "--output-len", "12", "--max-model-len", "256",
                     "--json", str(out)])
    report = json.loads(out.read_text())
    assert rc == 0 and report["identical_outputs"] is True
    assert report["same_steps"] in (True, False)
    for mode in ("sync", "async"):
        assert set(report[mode]) >= {"output_tok_s", "device_idle_frac", "mean_step_ms", "steps"}
        assert 0 < report[mode]["host_submit_ms"] < report[mode]["mean_step_ms"]
    assert report["speedup"] > 0
    assert out.with_suffix(".png").stat().st_size > 1000


@pytest.mark.live
def test_dp_benchmark_end_to_end(tiny_model_dir: Path, tmp_path: Path) -> None:
    """Two engines against one (the same outputs), and the prefix-heavy load finding more of
    its prefixes cached with prefix routing (the most it can: 1 of 2 rounds of 32 tokens)."""
    out = tmp_path / "dp.json"
    rc = bench.main(["dp", "--model", str(tiny_model_dir), "--device", "timed:1,0",
                     "--batch", "4", "--output-len", "4", "--groups", "4", "--rounds", "2",
                     "--prefix-len", "32", "--max-model-len", "256", "--json", str(out)])
    report = json.loads(out.read_text())
    assert rc == 0 and report["identical_outputs"] is True and report["ratio"] > 0
    hits = report["prefix_hit_rate"]
    assert hits["prefix"][0] == pytest.approx(0.5 * 32 / 34)
    # Load routing may by chance send a group's rounds to one engine (0.4706 both, once): it
    # finds at most what prefix routing finds, not always less.
    assert hits["load"][0] <= hits["prefix"][0]


@pytest.mark.live
def test_serve_benchmark_reports_cache_hits_and_preemptions(tmp_path: Path) -> None:
    model = build_tiny_llama(tmp_path / "long", max_len=8192)
    out = tmp_path / "s.json"
    # 180 blocks of 16 tokens (8 KiB each on this model) for five chats of 0.5k-1.3k tokens
    # sent at once, each with the same 64-word system message first.
    rc = bench.main(["serve", "--model", str(model), "--num-prompts", "5",
                     "--request-rate", "inf", "--system-prompt-words", "64",
                     "--kv-cache-memory", str(180 * 8192), "--max-model-len", "2048",
                     "--json", str(out)])
    report = json.loads(out.read_text())
    assert rc == 0 and report["completed"] == 5
    sched = report["scheduler"]
    # The requests after the first find the shared system prompt cached.
    assert sched["prefix_cache_hits"] >= 4 * 128
    assert 0 < sched["prefix_cache_hit_rate"] < 1
    assert sched["num_preemptions"] > 0
    assert sched["num_steps"] > 0


@pytest.mark.live
def test_serve_benchmark_drives_an_http_server(tmp_path: Path) -> None:
    from test_server import serve

    model = build_tiny_llama(tmp_path / "long", max_len=4096)
    out = tmp_path / "h.json"
    with serve(model, "--max-model-len", "4096") as server:
        rc = bench.main(["serve", "--base-url", f"{server.url}/v1", "--num-prompts", "4",
                         "--request-rate", "inf", "--json", str(out)])
        report = json.loads(out.read_text())
        tokens = round(report["output_token_throughput"] * report["duration_s"])
        deadline = time.monotonic() + 5  # the engine's counters come with its next status
        generated = f"vllm:generation_tokens_total{{model_name={server.model}}}"
        while (metrics := server.metrics())[generated] < tokens:
            assert time.monotonic() < deadline
            time.sleep(0.1)
        # vLLM's random workload: token-id prompts through /v1/completions, EOS ignored
        rc_random = bench.main(["serve", "--base-url", f"{server.url}/v1", "--model", str(model),
                                "--dataset", "random", "--input-len", "8", "--output-len", "5",
                                "--num-prompts", "3", "--json", str(tmp_path / "r.json")])
        random_report = json.loads((tmp_path / "r.json").read_text())
    assert rc == 0 and report["completed"] == 4 and report["failed"] == 0
    assert report["ttft_ms"]["p50"] > 0 and tokens > 0
    # the server counted the same requests and tokens the benchmark saw
    assert metrics[f"vllm:e2e_request_latency_seconds_count{{model_name={server.model}}}"] == 4
    assert metrics[generated] == tokens
    assert rc_random == 0 and random_report["completed"] == 3
    seconds = random_report["duration_s"]
    assert round(random_report["output_token_throughput"] * seconds) == 3 * 5
    assert round(random_report["total_token_throughput"] * seconds) == 3 * (8 + 5)


def test_random_samples_are_vllms_random_workload() -> None:
    from pipeline.tools.bench_serve import random_samples

    samples = random_samples(5, 16, 7, vocab_size=1000, seed=3)
    assert samples == random_samples(5, 16, 7, vocab_size=1000, seed=3)
    assert [len(s.prompt_ids) for s in samples] == [16] * 5
    assert all(s.output_tokens == 7 and 0 <= min(s.prompt_ids) for s in samples)
    assert max(max(s.prompt_ids) for s in samples) < 1000
    with pytest.raises(SystemExit):
        bench.main(["serve", "--peers", "sglang"])  # known: vllm-serve
    with pytest.raises(SystemExit, match="one --request-rate"):
        bench.main(["serve", "--peers", "vllm-serve", "--request-rate", "1,4"])


@pytest.mark.live
def test_serve_against_peers_starts_drives_and_stops_each_server(tiny_model_dir: Path,
                                                                 capsys: pytest.CaptureFixture[str]
                                                                 ) -> None:
    """The --peers machinery with our own server alone (no peer venv in CI): started on a free
    port, warmed, driven, stopped with its whole session; the table printed."""
    import argparse

    import psutil

    from pipeline.tools import bench_serve

    started: list[int] = []
    real_start = bench_serve.start_server

    def start(name: str, args: argparse.Namespace, log_dir: Path) -> bench_serve.Server:
        server = real_start(name, args, log_dir)
        started.append(server.proc.pid)
        return server

    args = bench.build_parser().parse_args(
        ["serve", "--model", str(tiny_model_dir), "--dataset", "random", "--input-len", "6",
         "--output-len", "4", "--num-prompts", "4", "--repeat", "2",
         "--kv-cache-memory", "64MiB"])
    samples = bench_serve.random_samples(4, 6, 4, 256, 0)
    bench_serve.start_server = start  # type: ignore[assignment]
    try:
        assert bench_serve.serve_against_peers(args, samples, samples[:1], "") == 0
    finally:
        bench_serve.start_server = real_start  # type: ignore[assignment]
    assert len(started) == 2 and not any(psutil.pid_exists(p) for p in started)
    table = capsys.readouterr().out
    assert "2 round(s) (medians)" in table and "output tok/s" in table
    # each stage's CPU while the load ran, per output token (the serving profile)
    assert "CPU s per 1,000 output tokens: " in table and "llm-pipeline:executor:0" in table


def test_serve_rounds_alternate_which_server_goes_first() -> None:
    from pipeline.tools.bench_serve import round_order

    names = ["ours", "vllm-serve"]
    assert [round_order(names, r) for r in range(3)] == [
        ["ours", "vllm-serve"], ["vllm-serve", "ours"], ["ours", "vllm-serve"]]
    assert round_order(["ours"], 1) == ["ours"]


def test_cpu_delta_sums_each_label_over_processes_alive_at_both_ends() -> None:
    from pipeline.tools.bench_serve import cpu_delta

    before = {1: ("llm-pipeline:api:0", 1.0), 2: ("llm-pipeline:api:1", 2.0), 3: ("x", 5.0)}
    after = {1: ("llm-pipeline:api:0", 1.5), 2: ("llm-pipeline:api:1", 2.25), 4: ("x", 9.0)}
    assert cpu_delta(before, after) == {"llm-pipeline:api:0": 0.5, "llm-pipeline:api:1": 0.25}


@pytest.mark.live
def test_throughput_benchmark_with_two_tensor_parallel_ranks(tmp_path: Path) -> None:
    """--tensor-parallel-size 2: the pipeline on two ranks, and on one beside it (the ratio
    tensor parallelism buys), with the same greedy outputs."""
    from pipeline.tools.random_model import build_random_llama

    model = build_random_llama(tmp_path / "m", heads=4, kv_heads=2)
    out = tmp_path / "tp.json"
    rc = bench.main(["throughput", "--model", str(model), "--num-prompts", "4", "--batch-size",
                     "2", "--input-len", "5", "--output-len", "6", "--peers", "",
                     "--tensor-parallel-size", "2", "--json", str(out)])
    report = json.loads(out.read_text())
    assert rc == 0 and report["config"]["tensor_parallel_size"] == 2
    assert report["pipeline-tp1"]["identical_to_pipeline"] == 4
    assert report["ratios"]["pipeline/pipeline-tp1"] > 0


def test_host_benchmark_times_each_part_of_steady_decode_steps() -> None:
    from pipeline.tools.bench_host import PARTS, run, summary

    times = run(batch=4, num_steps=30, prompt_len=8, output_len=20)
    assert set(times) == set(PARTS) and all(len(v) == 30 for v in times.values())
    assert all(t > 0 for v in times.values() for t in v)
    s = summary(times)
    assert s["steps"] == 30 and s["total"]["p99_ms"] >= s["total"]["median_ms"] > 0


def test_vllm_clients_results_read_as_our_summary() -> None:
    """bench serve --client vllm: `vllm bench serve`'s command for the run's load, and its
    result JSON (the keys vLLM 0.32 writes) read into summarize's shape, goodput under our
    SLOs from its per-request times."""
    from pipeline.tools.bench_serve import vllm_client_command, vllm_summary

    args = bench.build_parser().parse_args(
        ["serve", "--model", "/m", "--dataset", "random", "--input-len", "128", "--output-len",
         "3", "--num-prompts", "3", "--max-concurrency", "64", "--seed", "7", "--client", "vllm",
         "--slo-ttft-ms", "100", "--slo-tpot-ms", "20"])
    args.request_rate = args.request_rate[0]
    cmd = vllm_client_command(args, "http://127.0.0.1:9/v1", "bench-model", Path("/t/r.json"))
    assert cmd[1] == "-c" and "vllm.benchmarks.serve" in cmd[2]
    flags = {a: b for a, b in zip(cmd[3:], [*cmd[4:], ""], strict=True)
             if a.startswith("--") and not b.startswith("--")}
    assert flags["--base-url"] == "http://127.0.0.1:9" and flags["--tokenizer"] == "/m"
    assert (flags["--random-input-len"], flags["--random-output-len"]) == ("128", "3")
    assert (flags["--num-prompts"], flags["--request-rate"], flags["--seed"]) == ("3", "inf", "7")
    assert flags["--max-concurrency"] == "64"
    assert {"--ignore-eos", "--save-result", "--save-detailed"} <= set(cmd)
    assert (flags["--result-dir"], flags["--result-filename"]) == ("/t", "r.json")
    res = {"duration": 2.0, "completed": 3, "failed": 0, "num_prompts": 3,
           "request_throughput": 1.5, "output_throughput": 4.5, "total_token_throughput": 196.5,
           "ttfts": [0.05, 0.08, 0.2], "latencies": [0.09, 0.2, 0.24], "output_lens": [3, 3, 3],
           "errors": ["", "", ""]}
    for metric in ("ttft", "tpot", "itl", "e2el"):
        res |= {f"mean_{metric}_ms": 1.0, f"p50_{metric}_ms": 2.0, f"p90_{metric}_ms": 3.0,
                f"p99_{metric}_ms": 4.0, f"median_{metric}_ms": 2.0, f"std_{metric}_ms": 0.0}
    s = vllm_summary(res, args)
    assert (s["completed"], s["failed"], s["output_token_throughput"]) == (3, 0, 4.5)
    assert s["tpot_ms"] == {"mean": 1.0, "p50": 2.0, "p90": 3.0, "p99": 4.0}
    assert s["e2e_ms"]["p99"] == 4.0
    # TPOT 20, 60 and 20 ms, TTFT 50, 80 and 200 ms: only the first meets both SLOs
    assert s["goodput"]["fraction"] == pytest.approx(1 / 3)
    assert s["goodput"]["requests_per_s"] == pytest.approx(0.5)
    with pytest.raises(SystemExit, match="--client vllm drives servers"):
        bench.main(["serve", "--client", "vllm", "--dataset", "random"])
    with pytest.raises(SystemExit, match="add --dataset random"):
        bench.main(["serve", "--client", "vllm", "--base-url", "http://127.0.0.1:9/v1"])
