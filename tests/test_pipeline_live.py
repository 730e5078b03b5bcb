"""Integration: the four kinds of stage process on the tiny offline model, 2 tokenizers and
2 detokenizers; greedy outputs against transformers; errors, streaming, abort, shutdown."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest
from live import alive, kill_pids, live_config, shm_segments
from tiny_model import hf_greedy

from ipc.messages import ChatMessage, SamplingParams
from pipeline.runtime.launcher import Pipeline

pytestmark = [pytest.mark.live, pytest.mark.timeout(180)]

PROMPTS = ["The quick brown fox", "Paged attention stores keys and values", "Héllo wörld 🚀",
           "def main():", "Continuous batching lets new requests join at any step. " * 4,
           "a", "日本語のテキスト", "Grüße aus Köln. The lazy dog jumps."]


@pytest.fixture(scope="module")
def pipeline(tiny_model_dir: Path) -> Iterator[Pipeline]:
    pipe = Pipeline(live_config(tiny_model_dir, num_tokenizers=2, num_detokenizers=2,
                                max_num_batched_tokens=32))
    pids: list[int] = []
    try:
        pipe.start()
        pids = list(pipe.stage_pids.values())
        yield pipe
    finally:
        pipe.stop()
        kill_pids(pids or list(pipe.stage_pids.values()))


def test_stage_processes_are_named(pipeline: Pipeline) -> None:
    import psutil

    names = {n: " ".join(psutil.Process(pid).cmdline()) for n, pid in pipeline.stage_pids.items()}
    assert sorted(names) == ["detokenizer:0", "detokenizer:1", "executor:0", "scheduler:0",
                             "tokenizer:0", "tokenizer:1"]
    for name, title in names.items():
        assert f"llm-pipeline:{name}" in title


def test_greedy_matches_transformers(pipeline: Pipeline, tiny_model_dir: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    expected = hf_greedy(tiny_model_dir, [tok(p)["input_ids"] for p in PROMPTS], 20)
    outs = pipeline.client().generate(PROMPTS, SamplingParams(max_tokens=20, temperature=0.0))
    assert [o.token_ids for o in outs] == expected
    for out, ids in zip(outs, expected, strict=True):
        assert out.error is None and out.finish_reason in ("stop", "length")
        assert out.text == tok.decode(ids, skip_special_tokens=True)
        assert out.num_output_tokens == len(ids)


def test_bad_prompt_is_an_error_and_others_finish(pipeline: Pipeline) -> None:
    params = [SamplingParams(max_tokens=5, temperature=0.0), SamplingParams(max_tokens=-1),
              SamplingParams(max_tokens=5, temperature=0.0), SamplingParams(max_tokens=10**6)]
    outs = pipeline.client().generate(["hello", "bad", "world", "too long"], params)
    assert [o.finish_reason for o in outs] == ["length", "error", "length", "error"]
    assert "max_tokens" in (outs[1].error or "") and "context" in (outs[3].error or "")
    assert len(outs[0].token_ids) == 5 and len(outs[2].token_ids) == 5


def test_chat_and_token_id_prompts(pipeline: Pipeline) -> None:
    params = SamplingParams(max_tokens=4, temperature=0.0)
    outs = pipeline.client().generate([[ChatMessage("user", "hi")], [5, 6, 7]], params)
    assert [o.num_prompt_tokens for o in outs][1] == 3
    assert outs[0].num_prompt_tokens > 3 and all(o.error is None for o in outs)


def test_stream_yields_deltas_and_abort_stops(pipeline: Pipeline) -> None:
    client = pipeline.client()

    async def run() -> tuple[list[int], str | None]:
        ids: list[int] = []
        reason = None
        async for out in client.stream("The quick", SamplingParams(max_tokens=200,
                                                                   temperature=0.0,
                                                                   ignore_eos=True),
                                        request_id="to-abort"):
            ids += out.token_ids
            if len(ids) >= 3 and reason is None:
                client.abort("to-abort")
            reason = out.finish_reason
        return ids, reason

    ids, reason = asyncio.run(run())
    assert reason == "abort" and 3 <= len(ids) < 200


def test_after_stop_nothing_remains(tiny_model_dir: Path) -> None:
    pipe = Pipeline(live_config(tiny_model_dir))
    pids: list[int] = []
    try:
        pipe.start()
        pids = list(pipe.stage_pids.values())
        assert len(alive(pids)) == 4
        assert shm_segments(pipe.cfg.run_id) == []  # unlinked once every stage mapped them
        outs = pipe.client().generate(["hello"], SamplingParams(max_tokens=3))
        assert outs[0].num_output_tokens == 3
    finally:
        pipe.stop()
    try:
        assert alive(pids) == []
        assert not Path(pipe.cfg.run_dir).exists()
        assert shm_segments(pipe.cfg.run_id) == []
    finally:
        kill_pids(pids)


def test_startup_failure_names_the_stage_and_leaves_nothing(tiny_model_dir: Path,
                                                           tmp_path: Path) -> None:
    import shutil

    from pipeline.runtime.supervisor import StartupError

    broken = tmp_path / "broken"
    shutil.copytree(tiny_model_dir, broken)
    (broken / "model.safetensors").write_bytes(b"not weights")
    pipe = Pipeline(live_config(broken))
    with pytest.raises(StartupError, match="executor:0"):
        pipe.start()
    assert alive(list(pipe.stage_pids.values())) == []
    assert shm_segments(pipe.cfg.run_id) == [] and not Path(pipe.cfg.run_dir).exists()


def test_cache_smaller_than_one_sequence_is_refused(tiny_model_dir: Path) -> None:
    from pipeline.runtime.supervisor import StartupError

    pipe = Pipeline(live_config(tiny_model_dir, kv_cache_memory=64 * 1024))
    with pytest.raises(StartupError, match="raise --kv-cache-memory or lower --max-model-len"):
        pipe.start()
    assert alive(list(pipe.stage_pids.values())) == []


def test_a_request_with_a_bad_reply_address_does_not_kill_the_tokenizer(
        pipeline: Pipeline) -> None:
    import zmq

    from ipc.codec import encode
    from pipeline.runtime.client import make_add_request

    ctx = zmq.Context()
    try:
        for rank in range(2):
            sock = ctx.socket(zmq.PUSH)
            sock.connect(pipeline.cfg.tokenizer_address(rank))
            for reply_to in ("not an address", "ipc://"):
                sock.send(pipeline.cfg.keys.client_key.encode() + encode(make_add_request(
                    f"bad-{rank}", reply_to, "", SamplingParams(max_tokens=-1))))
            sock.close(linger=1000)
    finally:
        ctx.term()
    outs = pipeline.client().generate(["still", "alive"],
                                      SamplingParams(max_tokens=2, ignore_eos=True))
    assert [o.num_output_tokens for o in outs] == [2, 2]
    assert pipeline.is_alive
