"""The tokenizer's side of the data-parallel engines (stages/dispatch.py), without sockets:
where requests go, which ids a reconcile finds lost, what an engine that dies takes with it;
and the launcher's view of the engines (pipeline/runtime/engines.py)."""

from __future__ import annotations

import dataclasses

from ipc.messages import (
    EngineReconcile,
    Histogram,
    Message,
    Reconcile,
    ReconcileAnswer,
    RequestOutputs,
    SamplingParams,
    SchedulerStats,
    TokenizedRequest,
)
from pipeline.runtime.engines import EngineRestart, Engines, combine_stats
from stages.dispatch import RECENT_ROUTE_S, RECONCILE_TIMEOUT_S, Dispatcher
from stages.router import EngineRouter


class Harness:
    def __init__(self, num_engines: int = 2) -> None:
        self.now = 0.0
        self.sent: list[tuple[int, Message]] = []
        self.replies: list[tuple[str, str, str]] = []  # (address, request id, error)
        self.dispatcher = Dispatcher(EngineRouter(num_engines, 4, "load"), 3,
                                     lambda e, m: self.sent.append((e, m)), self.reply,
                                     clock=lambda: self.now)

    def reply(self, address: str, outputs: RequestOutputs) -> None:
        for out in outputs.outputs:
            assert out.finished and out.error_kind == "unavailable"
            self.replies.append((address, out.request_id, out.error or ""))

    def forward(self, rid: str, num_tokens: int = 8) -> int:
        self.dispatcher.forward(TokenizedRequest(rid, "client-a", list(range(num_tokens)),
                                                 SamplingParams(), 0.0))
        engine, msg = self.sent[-1]
        assert isinstance(msg, TokenizedRequest) and msg.request_id == rid
        return engine


def test_requests_spread_over_the_engines_by_load() -> None:
    h = Harness()
    assert [h.forward(f"r{i}") for i in range(4)] == [0, 1, 0, 1]
    h.dispatcher.set_status([100, 0], [True, True])  # published: engine 0 is busier
    assert [h.forward(f"s{i}") for i in range(2)] == [1, 1]


def test_a_reconcile_finds_lost_only_the_ids_no_engine_holds() -> None:
    h = Harness()
    h.dispatcher.reconcile(Reconcile("client-a", 3, ["a", "b", "c"]))
    asked = [(e, m) for e, m in h.sent if isinstance(m, EngineReconcile)]
    assert sorted(e for e, _ in asked) == [0, 1]
    nonce = asked[0][1].nonce
    h.dispatcher.on_answer(ReconcileAnswer(nonce, 0, ["a"]))
    assert h.replies == []  # engine 1 has not answered yet
    h.dispatcher.on_answer(ReconcileAnswer(nonce, 1, ["c"]))
    assert [(a, r) for a, r, _ in h.replies] == [("client-a", "b")]
    assert "tokenizer:3 stopped" in h.replies[0][2]
    h.dispatcher.on_answer(ReconcileAnswer(nonce, 1, []))  # late duplicate: nothing more
    assert len(h.replies) == 1


def test_a_reconcile_does_not_wait_for_an_engine_that_dies_or_never_answers() -> None:
    h = Harness()
    h.dispatcher.reconcile(Reconcile("client-a", 3, ["a", "b"]))
    nonce = next(m.nonce for _, m in h.sent if isinstance(m, EngineReconcile))
    h.dispatcher.on_answer(ReconcileAnswer(nonce, 0, ["a"]))
    h.dispatcher.set_status([0, 0], [True, False])
    assert [r for _, r, _ in h.replies] == ["b"]

    h = Harness()
    h.dispatcher.reconcile(Reconcile("client-a", 3, ["a"]))
    h.now += RECONCILE_TIMEOUT_S - 0.1
    h.dispatcher.expire()
    assert h.replies == []
    h.now += 0.2
    h.dispatcher.expire()
    assert [r for _, r, _ in h.replies] == ["a"]


def test_an_engine_that_dies_fails_what_was_sent_to_it_lately() -> None:
    h = Harness()
    old = h.forward("old")  # engine 0
    h.now += RECENT_ROUTE_S + 1  # long ago: its detokenizer knows it (EngineDown fails it)
    engines = {rid: h.forward(rid) for rid in ("x", "y", "z")}
    why = {str(old): f"scheduler:{old} died, exit code -9: no message"}
    h.dispatcher.set_status([0, 0], [old == 1, old == 0], why)  # the engine of "old" dies
    lost = sorted(r for r, e in engines.items() if e == old)
    assert sorted(r for _, r, _ in h.replies) == lost and lost
    assert all(f"engine {old} stopped (scheduler:{old} died, exit code -9" in text
               for _, _, text in h.replies)
    h.dispatcher.set_status([0, 0], [old == 1, old == 0], why)  # seen again: nothing more
    assert len(h.replies) == len(lost)
    assert h.forward("after") != old  # not routed to a dead engine
    h.dispatcher.set_status([0, 0], [True, True])  # started again: routed to once more
    assert old in {h.forward(f"again{i}") for i in range(8)}


def test_no_engine_left_is_an_unavailable_error() -> None:
    h = Harness()
    h.dispatcher.set_status([0, 0], [False, False])
    h.sent.clear()
    h.dispatcher.forward(TokenizedRequest("r", "client-a", [1, 2], SamplingParams(), 0.0))
    assert h.sent == [] and h.replies[-1][:2] == ("client-a", "r")


def stats(engine: int, **fields: object) -> SchedulerStats:
    base = SchedulerStats(100, 50, 8, 4, 3, 1, 1, 2, 4, 5, 0, 10, engine=engine)
    return dataclasses.replace(base, **fields)  # type: ignore[arg-type]


def test_the_engines_stats_add_up_as_one() -> None:
    a = stats(0, finished={"stop": 2}, step_seconds_buckets=[1, 2], device_idle_fraction=0.1,
              request_phases={"queue": Histogram([1, 0], 0.5)}, load_tokens=30, uptime_s=5.0)
    b = stats(1, finished={"stop": 1, "abort": 4}, step_seconds_buckets=[3, 4, 5],
              device_idle_fraction=0.3, request_phases={"queue": Histogram([0, 2], 1.0)},
              load_tokens=12, uptime_s=7.0)
    total = combine_stats([a, b])
    assert (total.num_blocks, total.num_free_blocks, total.num_running) == (200, 100, 8)
    assert total.finished == {"stop": 3, "abort": 4}
    assert total.step_seconds_buckets == [4, 6, 5]
    assert total.request_phases["queue"] == Histogram([1, 2], 1.5)
    assert abs(total.device_idle_fraction - 0.2) < 1e-9
    assert (total.load_tokens, total.uptime_s) == (42, 7.0)


def test_engines_know_their_processes_and_which_death_they_survive() -> None:
    engines = Engines(2, tensor_parallel_size=2)
    assert [engines.engine_of(n) for n in ("scheduler:1", "executor:3", "executor:1",
                                          "tokenizer:0")] == [1, 1, 0, None]
    assert engines.processes(1) == ["scheduler:1", "executor:2", "executor:3"]
    assert engines.combined() is None  # not every engine has reported
    engines.record(stats(0))
    engines.record(stats(1, load_tokens=9))
    assert engines.loads() == [0, 9] and engines.combined() is not None
    assert engines.can_lose("executor:2") == 1
    engines.take_down(1)
    assert engines.can_lose("scheduler:1") == 1  # its own processes, stopped by us
    assert engines.can_lose("executor:0") is None  # the last engine: the pipeline fails
    total = engines.combined()  # engine 1's gauges go, its counts stay
    assert total is not None and engines.loads() == [0, 0]
    assert (total.num_blocks, total.num_running, total.num_steps) == (100, 4, 20)
    assert Engines(1, 1).can_lose("scheduler:0") is None


def test_an_engine_that_dies_is_started_again_until_it_keeps_dying() -> None:
    """The launcher's decisions on a death of a local engine's process (its processes and the
    restart policy are the live tests'): restart while the policy allows; a death of the new
    processes while they start restarts again; the old processes' deaths while stopping are
    ignored; one that keeps dying stays down while another engine serves, else the pipeline
    fails. An engine back keeps its past counts in the totals."""
    allow, refuse = (lambda: 0.5), (lambda: None)
    engines = Engines(2, tensor_parallel_size=1)
    engines.record(stats(0))
    engines.record(stats(1))
    assert engines.after_death(1, allow) == ("restart", 0.5)
    engines.take_down(1)
    engines.restarting[1] = EngineRestart("scheduler:1 died", 0.0, 0.5, 1)
    assert engines.after_death(1, allow) == ("ignore", 0.0)  # its executor, stopped by us
    engines.restarting[1].phase = "loading"
    assert engines.after_death(1, allow) == ("restart", 0.5)  # the new executor died
    engines.restarting[1].phase = "starting"
    engines.back(1)
    assert engines.alive == [True, True] and engines.incarnation == [0, 1]
    assert engines.restarting == {} and engines.combined() is None  # until it reports
    engines.record(stats(1, num_steps=1))
    total = engines.combined()
    assert total is not None and total.num_steps == 10 + 10 + 1  # its first life's stay
    assert total.num_running == 8  # gauges: the live engines' only
    assert engines.after_death(1, refuse) == ("down", 0.0)  # keeps dying; engine 0 serves
    engines.take_down(1)
    assert engines.after_death(1, allow) == ("ignore", 0.0)  # down for good
    assert engines.after_death(0, refuse) == ("fail", 0.0)  # the last one keeps dying
    alone = Engines(1, 1)
    assert alone.after_death(0, allow) == ("restart", 0.5)
    assert alone.after_death(0, refuse) == ("fail", 0.0)
