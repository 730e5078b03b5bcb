"""The README's commands and code, pasted as a user would: its Python blocks run as scripts,
its `run_pipeline` lines run as shell commands, its `serve` block serves the default model
and answers its curl and the official client it names. A placeholder path (/path/to/...)
becomes the tiny model (/path/to/....gguf: the tiny model as a GGUF file), port 8000 a free
port.
Not run: ./scripts/test (this suite) and the benchmark lines (minutes each; their commands are
tested in tests/test_bench.py)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from live import alive, kill_pids
from test_server import free_port

from stages.executor import kernels

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
BLOCKS = re.findall(r"```(\w*)\n(.*?)```", README, re.DOTALL)
PLACEHOLDER = re.compile(r"/path/to/[\w-]+")
GGUF_PLACEHOLDER = re.compile(r"/path/to/[\w.-]+\.gguf")
pytestmark = [pytest.mark.live, pytest.mark.timeout(400), pytest.mark.slow]


def commands(block: str) -> list[str]:
    """The shell commands of a block: continuation lines joined, comments dropped."""
    joined = block.replace("\\\n", " ")
    return [line.split("  #")[0].strip() for line in joined.splitlines()
            if line.strip() and not line.lstrip().startswith("#")]


def shell(command: str, cwd: Path, model: Path, gguf: Path) -> subprocess.CompletedProcess[str]:
    command = GGUF_PLACEHOLDER.sub(str(gguf), command)
    command = PLACEHOLDER.sub(str(model), command).replace("./scripts/", f"{ROOT}/scripts/")
    return subprocess.run(command, shell=True, cwd=cwd, capture_output=True, text=True,
                          timeout=300)


def test_the_run_pipeline_lines(tiny_model_dir: Path, tiny_gguf_file: Path, tmp_path: Path
                                ) -> None:
    (tmp_path / "prompts.txt").write_text("What is 2+2?\nName a color.\n")
    lines = list(dict.fromkeys(c for lang, block in BLOCKS if not lang for c in commands(block)
                               if c.startswith("./scripts/run_pipeline") and " serve" not in c))
    assert len(lines) >= 5, lines  # (a line the README shows twice runs once)
    for command in lines:
        proc = shell(command, tmp_path, tiny_model_dir, tiny_gguf_file)
        if not kernels.available() and "the CPU kernels are not available" in proc.stderr:
            assert proc.returncode != 0  # (a quantized line, refused by name where they are
            continue                     # not built)
        assert proc.returncode == 0, (command, proc.stderr[-2000:])
        assert proc.stdout.strip(), command


def test_the_python_blocks(tiny_model_dir: Path, tmp_path: Path) -> None:
    blocks = [b for lang, b in BLOCKS if lang == "python"]
    assert len(blocks) >= 2
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    for i, code in enumerate(blocks):
        script = tmp_path / f"block{i}.py"
        script.write_text(PLACEHOLDER.sub(str(tiny_model_dir), code))
        proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                              timeout=300, env=env, cwd=tmp_path)
        assert proc.returncode == 0, (code, proc.stderr[-2000:])
        assert proc.stdout.strip()


def test_the_serve_block_answers_its_curl(tmp_path: Path) -> None:
    (block,) = [b for lang, b in BLOCKS if not lang and "run_pipeline serve" in b]
    serve, curl = commands(block)
    port = str(free_port())
    proc = subprocess.Popen(shell_line(serve.replace("8000", port)), shell=True, cwd=tmp_path,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                            start_new_session=True)
    import psutil

    pids: list[int] = []
    try:
        deadline = time.monotonic() + 180
        assert proc.stdout is not None
        for line in proc.stdout:
            if line.startswith("serving "):
                break
            assert time.monotonic() < deadline
        pids = [p.pid for p in psutil.Process(proc.pid).children(recursive=True)]
        answer = subprocess.run(shell_line(curl.replace("8000", port)), shell=True,
                                capture_output=True, text=True, timeout=120)
        assert answer.returncode == 0 and '"chat.completion"' in answer.stdout, answer
        _the_official_client_streams(int(port))
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(30)
        deadline = time.monotonic() + 10
        while alive(pids) and time.monotonic() < deadline:
            time.sleep(0.1)
        left = alive(pids)
        kill_pids(pids)
    assert left == [], "a process of the server outlived it"


def _the_official_client_streams(port: int) -> None:
    """The line after the block: the official client, streaming, gets the default model's
    answer (SmolLM2-135M-Instruct knows this one), and /metrics counts its first token."""
    import httpx
    from openai import OpenAI

    base = f"http://127.0.0.1:{port}"
    ttft = 'vllm:time_to_first_token_seconds_count{model_name="SmolLM2-135M-Instruct"}'

    def first_tokens() -> float:
        metrics = httpx.get(f"{base}/metrics", timeout=10).text
        return float(next(line for line in metrics.splitlines()
                          if line.startswith(ttft)).split()[-1])

    before = first_tokens()
    client = OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0)
    stream = client.chat.completions.create(
        model="SmolLM2-135M-Instruct", stream=True, max_tokens=16, temperature=0,
        messages=[{"role": "user", "content": "What is the capital of France?"}])
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert "Paris" in text
    assert first_tokens() == before + 1


def shell_line(command: str) -> str:
    return command.replace("./scripts/", f"{ROOT}/scripts/")
