"""The default model (SmolLM2-135M-Instruct) through the live pipeline and the CLI: greedy
outputs token for token equal to transformers generate; the CLI contract; clean shutdown."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import psutil
import pytest
from live import (
    alive,
    kill_pids,
    leaked_segments,
    live_config,
    mapped_segments,
    our_segments,
    running,
)
from tiny_model import hf_greedy

from ipc.messages import SamplingParams
from stages.executor.backends.select import compile_unavailable

pytestmark = [pytest.mark.live, pytest.mark.slow, pytest.mark.timeout(300)]
ROOT = Path(__file__).resolve().parents[1]

PROMPTS = [
    "What is the capital of France?",
    "Write a short poem about autumn leaves falling in the park.",
    "1, 2, 3, 4,",
    "Translate to French: I like cheese.",
    "Explain what a paged KV cache is, in detail, for an engineer who knows databases "
    "but not machine learning. Mention blocks, free lists and reference counts.",
    "Hi",
    "Les élèves étudient à l'école: ça se passe bien? 日本語も少し。",
    "def fibonacci(n):",
    "The three primary colours are",
]


@pytest.fixture(scope="module")
def expected(default_model_dir: Path) -> tuple[list[list[int]], list[str]]:
    """transformers' greedy tokens and their text for PROMPTS, once for both forwards."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(default_model_dir)
    ids = hf_greedy(default_model_dir, [tok(p)["input_ids"] for p in PROMPTS], 24)
    return ids, [tok.decode(e, skip_special_tokens=True) for e in ids]


@pytest.mark.parametrize("compile", [False, True], ids=["eager", "compiled"])
def test_greedy_matches_transformers(default_model_dir: Path, compile: bool,
                                     expected: tuple[list[list[int]], list[str]]) -> None:
    """Through the live pipeline, eager (packed weights) and compiled (padded buckets,
    FlexAttention), with chunked prefill (a 64-token budget)."""
    if compile and compile_unavailable("cpu"):
        pytest.skip("TorchInductor needs a C++ compiler here")
    cfg = live_config(default_model_dir, max_num_batched_tokens=64, max_model_len=1024,
                      compile=compile)
    with running(cfg) as pipe:
        outs = pipe.client().generate(PROMPTS, SamplingParams(max_tokens=24, temperature=0.0))
    assert [o.token_ids for o in outs] == expected[0]
    assert [o.text for o in outs] == expected[1]


def _cli(*args: str) -> list[str]:
    return [str(ROOT / "scripts" / "run_pipeline"), *args]


def test_cli_generate_json_lines_with_an_error_line_and_exit_code_1() -> None:
    proc = subprocess.run(
        _cli("generate", "--prompt", "What is 2+2?", "--prompt", "", "--prompt", "Say hi",
             "--max-tokens", "8", "--json", "--tokenizer-workers", "2"),
        capture_output=True, text=True, timeout=240)
    assert proc.returncode == 1 and "1 of 3 prompts failed" in proc.stderr, proc.stderr
    lines = sorted((json.loads(line) for line in proc.stdout.splitlines()),
                   key=lambda line: line["index"])  # written as each finishes
    assert [line["index"] for line in lines] == [0, 1, 2]
    assert [line["prompt"] for line in lines] == ["What is 2+2?", "", "Say hi"]
    keys = {"index", "text", "token_ids", "finish_reason", "num_prompt_tokens",
            "num_output_tokens", "error"}
    assert all(keys <= set(line) for line in lines)
    assert lines[1]["finish_reason"] == "error" and "empty" in lines[1]["error"]
    for line in (lines[0], lines[2]):
        assert line["error"] is None and line["finish_reason"] in ("stop", "length")
        assert 0 < line["num_output_tokens"] == len(line["token_ids"]) <= 8


def test_cli_generate_json_with_request_semantics() -> None:
    proc = subprocess.run(
        _cli("generate", "--chat", "--prompt", "List three fruits.", "--prompt",
             "List three colors.", "--max-tokens", "24", "--temperature", "0.7", "--seed", "3",
             "--top-p", "0.9", "--n", "2", "--logprobs", "1", "--stop", ".", "--json"),
        capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr
    lines = sorted((json.loads(line) for line in proc.stdout.splitlines()),
                   key=lambda line: line["index"])
    assert [line["index"] for line in lines] == [0, 1]
    for line in lines:
        assert line["error"] is None
        assert {"finish_reason", "stop_reason", "samples", "logprobs",
                "num_cached_prompt_tokens"} <= set(line)
        assert len(line["samples"]) == 2
        for s in line["samples"]:
            assert set(s) == {"text", "token_ids", "num_output_tokens", "finish_reason",
                              "stop_reason", "logprobs"}
            assert s["num_output_tokens"] == len(s["token_ids"])
            assert "." not in s["text"]
            assert s["finish_reason"] in ("stop", "length")
            if s["stop_reason"] == ".":
                assert s["finish_reason"] == "stop"
            assert [lp["token_id"] for lp in s["logprobs"]] == s["token_ids"]
            assert all(len(lp["top_logprobs"]) == 1 for lp in s["logprobs"])
        assert line["text"] == line["samples"][0]["text"]
        assert line["num_output_tokens"] == len(line["token_ids"])  # sample 0's, as text
        assert line["total_output_tokens"] == sum(len(s["token_ids"])
                                                  for s in line["samples"])
    # Both prompts share the chat template's system prompt: the second finds it cached.
    assert max(line["num_cached_prompt_tokens"] for line in lines) >= 16


def test_cli_structured_outputs_and_prompt_logprobs(tmp_path: Path) -> None:
    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps({"type": "object", "properties": {"color": {
        "enum": ["red", "green", "blue"]}}, "required": ["color"]}))
    proc = subprocess.run(
        _cli("generate", "--chat", "--prompt", "Pick a color, as JSON.", "--max-tokens", "40",
             "--json-schema", f"@{schema}", "--prompt-logprobs", "1", "--json"),
        capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr
    line = json.loads(proc.stdout)
    assert json.loads(line["text"])["color"] in ("red", "green", "blue")
    scored = line["prompt_logprobs"]
    assert len(scored) == line["num_prompt_tokens"] and scored[0]["logprob"] is None
    assert all(s["logprob"] <= 0 and len(s["top_logprobs"]) == 1 for s in scored[1:])
    both = subprocess.run(_cli("generate", "--prompt", "x", "--regex", "a", "--choice", "b"),
                          capture_output=True, text=True, timeout=60)
    assert both.returncode != 0 and "--regex and --choice" in both.stderr


def _stage_children(pid: int) -> list[int]:
    out = []
    for child in psutil.Process(pid).children(recursive=True):
        try:  # the CLI's bootstrap runs short-lived helpers: one may be gone, or a zombie
            if "llm-pipeline:" in " ".join(child.cmdline()):
                out.append(child.pid)
        except psutil.Error:
            pass
    return out


def _wait_for_stages(pid: int, count: int = 4, timeout: float = 120) -> list[int]:
    """The stage processes under pid once `count` of them run (or what there is at timeout)."""
    deadline = time.monotonic() + timeout
    children = _stage_children(pid)
    while len(children) < count and time.monotonic() < deadline:
        time.sleep(0.2)
        children = _stage_children(pid)
    return children


def _run_dirs() -> list[str]:
    import tempfile

    base = os.environ.get("XDG_RUNTIME_DIR") or tempfile.gettempdir()
    return [n for n in os.listdir(base) if n.startswith("llm-pipeline-")]


def _describe(pids: list[int]) -> str:
    out = []
    for pid in pids:
        try:
            p = psutil.Process(pid)
            out.append(f"{pid} {p.status()} {' '.join(p.cmdline())} ppid={p.ppid()}")
        except psutil.NoSuchProcess:
            pass
    return "; ".join(out)


def test_cli_fails_the_prompts_a_dead_engine_held_and_exits_1(tmp_path: Path) -> None:
    """kill -9 of the executor under `generate`: both prompts' requests fail at once with
    the death named (the engine is started again behind them); the CLI says how many failed
    in one line (no traceback) and exits 1, leaving nothing behind."""
    before = our_segments()
    proc = subprocess.Popen(_cli("--device", "timed:20,0", "generate", "--prompt", "a",
                                 "--prompt", "b", "--max-tokens", "2000", "--ignore-eos"),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    children: list[int] = []
    try:
        children = _wait_for_stages(proc.pid)
        time.sleep(1)
        (executor,) = [c for c in children
                       if "executor" in " ".join(psutil.Process(c).cmdline())]
        os.kill(executor, signal.SIGKILL)
        out, err = proc.communicate(timeout=60)
        assert proc.returncode == 1, err
        assert "Traceback" not in err, err
        assert "error: 2 of 2 prompts failed" in err, err
        assert out.count("engine 0 stopped (executor:0 died, exit code -9") == 2, out
        assert leaked_segments(before) == []
    finally:
        if proc.poll() is None:
            proc.kill()
        kill_pids(children)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGKILL])
def test_cli_stops_every_stage_on_signal(sig: signal.Signals, tmp_path: Path) -> None:
    """Ctrl-C, SIGTERM or the parent's death: no stage process and nothing in /dev/shm remains."""
    before = our_segments()
    runs_before = set(_run_dirs())
    log = (tmp_path / "stderr.txt").open("w")
    proc = subprocess.Popen(_cli("generate", "--prompt", "Count to one thousand: 1, 2, 3,",
                                 "--max-tokens", "2000", "--json"),
                            stdout=subprocess.DEVNULL, stderr=log)
    children: list[int] = []
    try:
        children = _wait_for_stages(proc.pid)
        assert len(children) == 4, "the four stages did not start"
        time.sleep(2)
        proc.send_signal(sig)
        proc.wait(timeout=60)
        deadline = time.monotonic() + 60
        while alive(children) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert alive(children) == [], (_describe(alive(children)),
                                       (tmp_path / "stderr.txt").read_text()[-3000:])
        assert leaked_segments(before) == []
        assert set(_run_dirs()) - runs_before == set()  # nor its run directory
    finally:
        if proc.poll() is None:
            proc.kill()
        kill_pids(children)


def test_launcher_killed_during_start_up_leaves_nothing(tmp_path: Path) -> None:
    """kill -9 of the CLI while its stages are still starting (the executor has created the
    rings, the launcher has not unlinked them yet): the orphaned stages stop and remove the
    run directory and both segments."""
    runs_before = set(_run_dirs())
    proc = subprocess.Popen(_cli("generate", "--prompt", "Hi", "--max-tokens", "4"),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    children: list[int] = []
    rings: set[str] = set()  # this run's, named in /dev/shm and mapped by its stages
    try:
        deadline = time.monotonic() + 120
        while not rings and time.monotonic() < deadline:
            time.sleep(0.02)
            children = _stage_children(proc.pid)
            rings = mapped_segments(children) & our_segments()
        assert children, "no stage started"
        assert rings, "the rings should exist while the stages start"
        proc.kill()
        proc.wait(timeout=30)
        deadline = time.monotonic() + 60
        while alive(children) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert alive(children) == [], _describe(alive(children))
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and (rings & our_segments()
                                               or set(_run_dirs()) - runs_before):
            time.sleep(0.2)
        assert rings & our_segments() == set()
        assert set(_run_dirs()) - runs_before == set()
    finally:
        if proc.poll() is None:
            proc.kill()
        kill_pids(children)
