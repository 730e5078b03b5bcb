"""The offline API (`pipeline.LLM`), as users write it: a plain script with no `__main__`
guard, a notebook's running event loop, generate and chat with a progress bar, outputs in
vLLM's shape; its processes and shared memory end with close(), with the object, and with
the interpreter."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from live import alive, kill_pids, leaked_segments, our_segments

ROOT = Path(__file__).resolve().parent.parent
pytestmark = [pytest.mark.live, pytest.mark.timeout(240)]


def run_script(code: str, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    script = tmp_path / "user_script.py"
    script.write_text(textwrap.dedent(code))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=200, env=env, cwd=tmp_path)


def test_a_plain_script_without_a_main_guard(tiny_model_dir: Path, tmp_path: Path) -> None:
    before = our_segments()
    proc = run_script(f"""
        import json
        from pipeline import LLM, SamplingParams

        llm = LLM(model={str(tiny_model_dir)!r}, max_num_seqs=8)
        outs = llm.generate(["Hello", "Bonjour", [5, 6, 7]],
                            SamplingParams(max_tokens=5, temperature=0, n=2))
        chat = llm.chat([{{"role": "user", "content": "Hi!"}}], SamplingParams(max_tokens=4))
        print(json.dumps({{
            "pids": list(llm._pipeline.stage_pids.values()),
            "prompts": [o.prompt for o in outs],
            "texts": [[s.text for s in o.outputs] for o in outs],
            "tokens": [[len(s.token_ids) for s in o.outputs] for o in outs],
            "chat": [chat[0].prompt, chat[0].outputs[0].text, chat[0].error]}}))
        # no close(): the interpreter's exit stops the pipeline
    """, tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["prompts"] == ["Hello", "Bonjour", [5, 6, 7]]
    assert result["tokens"] == [[5, 5]] * 3
    assert result["chat"][0] == [{"role": "user", "content": "Hi!"}] and not result["chat"][2]
    assert "3/3" in proc.stderr and "tok/s" in proc.stderr  # the progress bar
    assert alive(result["pids"]) == [] and not leaked_segments(before)
    kill_pids(result["pids"])


def test_close_and_garbage_collection_end_the_processes(tiny_model_dir: Path) -> None:
    import gc

    from ipc.messages import SamplingParams
    from pipeline import LLM

    before = our_segments()
    with LLM(model=str(tiny_model_dir)) as llm:
        pids = list(llm._pipeline.stage_pids.values())
        assert llm.generate("hi", SamplingParams(max_tokens=2), use_tqdm=False)[0].error is None
        # chat_template_kwargs reach the template, checked by the tokenizer stage
        chat = [{"role": "user", "content": "hi"}]
        assert llm.chat(chat, SamplingParams(max_tokens=2), use_tqdm=False,
                        chat_template_kwargs={"x": 1})[0].error is None
        refused = llm.chat(chat, SamplingParams(max_tokens=2), use_tqdm=False,
                           chat_template_kwargs={"tools": []})[0]
        assert "chat_template_kwargs may not set ['tools']" in (refused.error or "")
    assert alive(pids) == [] and not leaked_segments(before)
    llm = LLM(model=str(tiny_model_dir))
    pids = list(llm._pipeline.stage_pids.values())
    del llm
    gc.collect()
    assert alive(pids) == [] and not leaked_segments(before)
    kill_pids(pids)


def test_inside_a_running_event_loop_as_in_a_notebook(tiny_model_dir: Path) -> None:
    import asyncio

    from ipc.messages import SamplingParams
    from pipeline import LLM

    async def cell() -> list[str]:  # a notebook cell runs with the kernel's loop running
        with LLM(model=str(tiny_model_dir)) as llm:
            outs = llm.generate(["a", "b"], SamplingParams(max_tokens=3), use_tqdm=False)
            return [o.outputs[0].text for o in outs]

    texts = asyncio.run(cell())
    assert len(texts) == 2
