"""A pipeline that stages on other hosts join (tests/test_remote_stages.py runs it, in a
network namespace of its own or on this host):

    python tests/remote_driver.py MODEL_DIR LISTEN_HOST STAGE_KEY KIND[,KIND...] [N] [TEXT]

It prints `address tcp://...`, waits until one stage of each KIND has joined, then sends N
prompts through a client that reaches it over tcp:// (as a client on another host would):
token ids, or with TEXT the texts "i: TEXT" (they differ first, so both engines get some);
prints one JSON line (what came back, each engine's steps, who served) and stops.

KIND `pipeline` alone: the model on the CPU in two pipeline stages, the second joined from
the other host (tests/live.py ranks_config's limits, greedy); it waits until the engine
serves, then sends the prompts of ID_PROMPTS (JSON) and TEXT, and prints their tokens."""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from ipc.addresses import RemoteSettings  # noqa: E402
from ipc.config import ExecutorConfig, PipelineConfig, RunKeys, SchedulerConfig  # noqa: E402
from ipc.messages import SamplingParams  # noqa: E402
from ipc.model_info import ModelInfo  # noqa: E402
from pipeline.runtime.client import PipelineClient  # noqa: E402
from pipeline.runtime.launcher import Pipeline  # noqa: E402


def main() -> None:
    model_dir, host, key, kinds = sys.argv[1:5]
    text = sys.argv[6] if len(sys.argv) > 6 else ""
    if kinds == "pipeline":
        return pipeline_stages(model_dir, host, key, sys.argv[5], text)
    num_prompts = int(sys.argv[5]) if len(sys.argv) > 5 else 16
    cfg = PipelineConfig(model=ModelInfo.from_dir(model_dir),
                         scheduler=SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=256),
                         executor=ExecutorConfig.for_device("timed:3,0",
                                                            kv_cache_memory=32 << 20),
                         remote=RemoteSettings(listen_host=host), keys=RunKeys(stage_key=key),
                         ready_timeout_s=120)
    with Pipeline(cfg) as pipe:
        print(f"address {pipe.address}", flush=True)
        assert pipe.roster is not None
        wanted = set(kinds.split(","))
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            joined = {m.kind for m in pipe.roster.members.values() if m.joined and m.ready}
            if wanted <= joined:
                break
            time.sleep(0.1)
        else:
            raise SystemExit(f"not joined within 120 s: {sorted(wanted - joined)}")
        client = PipelineClient.connect(pipe.address, key=pipe.cfg.keys.client_key)
        prompts = [f"{i}: {text}" if text else [3 + i, 4, 5, 6] for i in range(num_prompts)]
        outs = client.generate(prompts, SamplingParams(max_tokens=6, ignore_eos=True),
                               timeout=60)
        time.sleep(0.5)  # the engines' last stats
        result = {
            "finish": sorted({str(o.finish_reason) for o in outs}),
            "tokens": [len(o.token_ids) for o in outs],
            "engine_steps": [s.num_steps if s else 0 for s in pipe.engines.stats],
            "client_tokenizers": list(client.endpoints.tokenizers),
            "stages": pipe.status().stages,
            "joined": sorted(m.name for m in pipe.roster.members.values() if m.joined),
            "run_id": pipe.cfg.run_id,
            "client_key": pipe.cfg.keys.client_key,
        }
        client.close()
        print(json.dumps(result), flush=True)


def pipeline_stages(model_dir: str, host: str, key: str, id_prompts: str, text: str) -> None:
    from live import ranks_config, stream_and_abort

    base = ranks_config(Path(model_dir), pipeline_parallel_size=2)
    cfg = dataclasses.replace(
        base, executor=dataclasses.replace(base.executor, joined_pipeline_stages=1),
        remote=RemoteSettings(listen_host=host), keys=RunKeys(stage_key=key))
    with Pipeline(cfg) as pipe:
        print(f"address {pipe.address}", flush=True)
        client = PipelineClient.connect(pipe.address, key=pipe.cfg.keys.client_key)
        deadline = time.monotonic() + 120
        while pipe.engines.restarting or not client.health().ok:
            if time.monotonic() > deadline:
                raise SystemExit(f"the engine did not serve within 120 s: "
                                 f"{pipe.engines.down_why}")
            time.sleep(0.1)
        greedy = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
        prompts: list[list[int] | str] = [*json.loads(id_prompts), text]
        outs = client.generate(prompts, greedy, timeout=60)
        # (this client connected before the engine ran: it found the engine as it started)
        abort = stream_and_abort(client, [5, 6, 7], max_tokens=90, after=2)
        result = {"tokens": [o.token_ids for o in outs], "abort": abort,
                  "errors": [o.error for o in outs if o.error],
                  "ranks": pipe.status().ranks, "run_id": pipe.cfg.run_id,
                  "client_key": pipe.cfg.keys.client_key}
        client.close()
        print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
