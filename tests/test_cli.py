"""The CLI's `generate` as a long run uses it, on the tiny model: a prompts file whose empty
lines keep their index, JSON lines as each prompt finishes with the prompt echoed, a
progress bar, what is wrong with the arguments said before anything starts, Ctrl-C keeping
what finished, and the default length bound."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import pytest
from live import alive, kill_pids

from pipeline.cli import DEFAULT_MAX_TOKENS, build_parser

ROOT = Path(__file__).resolve().parent.parent
pytestmark = [pytest.mark.live, pytest.mark.timeout(240)]


def cli(model: Path, *args: str) -> list[str]:
    return [str(ROOT / "scripts" / "run_pipeline"), "--model", str(model), *args]


def test_a_prompts_file_json_lines_and_progress(tiny_model_dir: Path, tmp_path: Path) -> None:
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("first line\n\n   \nfourth line\nfifth\n")
    proc = subprocess.run(cli(tiny_model_dir, "generate", "--prompt", "given", "--prompts-file",
                              str(prompts), "--json", "--max-tokens", "6", "--progress",
                              "--n", "2", "--temperature", "1", "--seed", "1"),
                          capture_output=True, text=True, timeout=200)
    assert proc.returncode == 0, proc.stderr
    lines = {json.loads(line)["index"]: json.loads(line) for line in proc.stdout.splitlines()}
    # --prompt first (0), then the file's lines by their place (the blank 2 and 3 skipped)
    assert {i: line["prompt"] for i, line in lines.items()} == {
        0: "given", 1: "first line", 4: "fourth line", 5: "fifth"}
    for line in lines.values():
        assert line["num_output_tokens"] == len(line["token_ids"]) <= 6
        assert line["total_output_tokens"] == sum(s["num_output_tokens"]
                                                  for s in line["samples"])
    assert "4/4" in proc.stderr and "tok/s" in proc.stderr and "prompt" in proc.stderr


@pytest.mark.parametrize("args, words", [
    (["--prompts-file", "/nonexistent/prompts.txt"], "--prompts-file /nonexistent/prompts.txt"),
    (["--prompt", "x", "--top-p", "0"], "--top-p: top_p must be in (0, 1]"),
    (["--prompt", "x", "--json-schema", "{oops"], "--json-schema is not valid JSON"),
    (["--prompt", "x", "--max-tokens", "many"], "argument --max-tokens"),
])
def test_bad_arguments_are_one_line_before_anything_starts(tiny_model_dir: Path,
                                                           args: list[str], words: str) -> None:
    proc = subprocess.run(cli(tiny_model_dir, "generate", *args), capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 2 and words in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr and "pipeline" not in proc.stdout


def test_ctrl_c_keeps_what_finished_and_says_how_many_did_not(tiny_model_dir: Path) -> None:
    # the timed device: 50 ms a step, so nothing ends within the 2 s before Ctrl-C. The run
    # directory goes under a folder of this test's (short: socket paths are bounded), where
    # its pipeline.json says every stage is ready (a start can take longer than 2 s).
    tmp_path = Path(tempfile.mkdtemp(prefix="ctrl-c-"))
    env = {**os.environ, "TMPDIR": str(tmp_path), "XDG_RUNTIME_DIR": ""}
    proc = subprocess.Popen(cli(tiny_model_dir, "--device", "timed:50,0", "generate", "--prompt",
                                "a", "--prompt", "b", "--max-tokens", "none", "--ignore-eos",
                                "--json"),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    import psutil

    children: list[int] = []
    try:
        deadline = time.monotonic() + 120
        while not list(tmp_path.glob("llm-pipeline-*/pipeline.json")):
            assert time.monotonic() < deadline and proc.poll() is None, "it did not start"
            time.sleep(0.1)
        children = [c.pid for c in psutil.Process(proc.pid).children(recursive=True)
                    if "llm-pipeline:" in " ".join(c.cmdline())]
        assert len(children) == 4
        time.sleep(2)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
        assert proc.returncode == 130, err
        assert "interrupted: 0 of 2 prompts finished" in err and "2 did not" in err, err
        assert out == ""  # nothing finished
        deadline = time.monotonic() + 30
        while alive(children) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert alive(children) == []
    finally:
        if proc.poll() is None:
            proc.kill()
        kill_pids(children)
        shutil.rmtree(tmp_path, ignore_errors=True)


def test_the_default_length_is_bounded_and_said() -> None:
    args = build_parser().parse_args(["generate", "--prompt", "x"])
    assert args.max_tokens == DEFAULT_MAX_TOKENS == 256
    assert build_parser().parse_args(["generate", "--prompt", "x", "--max-tokens",
                                      "none"]).max_tokens is None


def test_a_gpu_asked_of_a_cpu_torch_is_refused_with_how_to_get_one(tiny_model_dir: Path) -> None:
    import torch

    if torch.version.cuda is not None:
        pytest.skip("this torch has CUDA")
    for device in ("cuda", "cuda:1"):
        proc = subprocess.run(cli(tiny_model_dir, "--device", device, "generate", "--prompt",
                                  "hi"), capture_output=True, text=True, timeout=60)
        assert proc.returncode == 2 and "is a CPU build" in proc.stderr, proc.stderr
        assert "pip install torch==2.13.0 --index-url" in proc.stderr
        assert "Traceback" not in proc.stderr


def test_a_stage_that_fails_to_start_is_one_line_unless_debug(tiny_model_dir: Path,
                                                               tmp_path: Path) -> None:
    import shutil

    broken = tmp_path / "no-weights"
    shutil.copytree(tiny_model_dir, broken)
    for weights in broken.glob("*.safetensors"):
        weights.unlink()
    quiet = subprocess.run(cli(broken, "generate", "--prompt", "hi"), capture_output=True,
                           text=True, timeout=120)
    assert quiet.returncode == 1 and "Traceback" not in quiet.stderr, quiet.stderr
    assert "error: the pipeline did not start: stage executor:0 failed to start: " \
           "FileNotFoundError" in quiet.stderr
    loud = subprocess.run(cli(broken, "--debug", "generate", "--prompt", "hi"),
                          capture_output=True, text=True, timeout=120)
    assert loud.returncode == 1 and "Traceback" in loud.stderr


def test_help_and_version() -> None:
    run = [str(ROOT / "scripts" / "run_pipeline")]
    top = subprocess.run([*run, "--help"], capture_output=True, text=True, timeout=60).stdout
    assert "run_pipeline serve" in top and "run_pipeline generate" in top
    assert "(default: cpu)" in top
    gen = subprocess.run([*run, "generate", "--help"], capture_output=True, text=True,
                         timeout=60).stdout
    assert "(default: 256)" in gen and "--json-schema" in gen
    import pipeline

    version = subprocess.run([*run, "--version"], capture_output=True, text=True, timeout=60)
    assert version.stdout.strip() == f"run_pipeline {pipeline.__version__}"


def test_the_package_builds_with_every_subpackage_and_the_command(tmp_path: Path) -> None:
    """`pip install .` installs what a wheel built here holds: every package under the card's
    three folders, and the llm-pipeline command."""
    import shutil
    import sys
    import zipfile

    source = tmp_path / "src"
    for name in ("ipc", "stages", "pipeline"):
        shutil.copytree(ROOT / name, source / name,
                        ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", str(source),
                           "-w", str(tmp_path / "dist")], capture_output=True, text=True,
                          timeout=200)
    assert proc.returncode == 0, proc.stderr
    (wheel,) = (tmp_path / "dist").glob("llm_pipeline-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for module in ("ipc/arch.py", "stages/executor/runner.py", "stages/scheduler/core.py",
                   "pipeline/server/app.py", "pipeline/runtime/launcher.py",
                   "pipeline/tools/bench.py"):
        assert module in names, module
    (entry_points,) = [n for n in names if n.endswith("entry_points.txt")]
    text = zipfile.ZipFile(wheel).read(entry_points).decode()
    assert "llm-pipeline = pipeline.cli:main" in text
