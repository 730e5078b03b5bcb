"""The pipeline's status (which stages live, joined or left, the engines' accounting, restarts)
and its publisher, which sends it a few times a second and on every death. Runs in the
launcher's process; the publisher's socket is its supervisor thread's."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

import zmq

from ipc.codec import Codec
from ipc.config import PipelineConfig
from ipc.messages import PipelineStatus
from pipeline.runtime.engines import Engines
from pipeline.runtime.restarts import RESTARTABLE
from pipeline.runtime.roster import Roster
from pipeline.runtime.supervisor import Supervisor

STATUS_INTERVAL_S = 0.25  # between two statuses when nothing happens


def pipeline_status(supervisor: Supervisor, engines: Engines, roster: Roster | None,
                    failure: str | None, public_host: str = "") -> PipelineStatus:
    """A dead tokenizer or detokenizer counts as alive while the pipeline has not failed:
    it is being started again, and the pipeline still serves. public_host: with --listen,
    where remote clients reach this host's engines' abort inboxes."""
    alive = {name: up or (name.split(":")[0] in RESTARTABLE and failure is None)
             for name, up in supervisor.alive().items()}
    joined: dict[str, str] = {}
    left: list[str] = []
    if roster is not None:  # (one that left is not a stage of the pipeline now)
        alive |= {m.name: True for m in roster.members.values() if m.joined and not m.gone}
        joined, left = roster.joined_addresses(), roster.left()
    restarting = sorted(engines.restarting)
    for engine in restarting:  # (it serves again soon: not a dead stage of the pipeline)
        alive |= {name: True for name in engines.processes(engine) if name in alive}
    return PipelineStatus(time.time(), alive, failure, engines.combined(),
                          dict(supervisor.restarts.counts), engines.loads(),
                          list(engines.alive), joined, left=left,
                          engines_restarting=restarting,
                          engines_down_why=dict(engines.down_why), ranks=rank_places(engines),
                          rendezvous={engines.hosts[e]: address
                                      for e, address in engines.rendezvous.items()},
                          abort_inboxes=abort_inboxes(supervisor, engines, public_host))


def abort_inboxes(supervisor: Supervisor, engines: Engines, public_host: str) -> dict[str, str]:
    """Each serving engine of this host's tcp:// abort inbox (its scheduler's tcp_port)."""
    if not public_host:
        return {}
    ports = {e: supervisor.ready.get(f"scheduler:{e}", {}).get("tcp_port")
             for e in range(engines.num_engines) if engines.alive[e]}
    return {str(e): f"tcp://{public_host}:{port}" for e, port in ports.items() if port}


def rank_places(engines: Engines) -> dict[str, str]:
    """Each executor rank's engine, stage and tensor rank, where an engine has several."""
    layout = engines.layout
    if layout.ranks_per_engine == 1:
        return {}
    return {f"executor:{r}": layout.describe(r)
            for e in range(engines.num_engines) for r in layout.engine_ranks(e)}


class StatusPublisher:
    """The PUB socket clients and joined stages subscribe to (ipc://; Bootstrap adds tcp://)."""

    def __init__(self, zctx: zmq.Context, cfg: PipelineConfig) -> None:
        self.socket = zctx.socket(zmq.PUB)
        self.socket.setsockopt(zmq.LINGER, 1000)  # the last status (a failure) gets out
        self.socket.bind(cfg.status_address)
        self._next = 0.0

    def publish(self, status: Callable[[], PipelineStatus], force: bool = False) -> None:
        """Send status() if one is due, or at once with `force` (a stage died). (A callable:
        the status is built only when sent.)"""
        if force or time.monotonic() >= self._next:
            self.socket.send(Codec.encode(status()))
            self._next = time.monotonic() + STATUS_INTERVAL_S

    def last(self, status: PipelineStatus) -> None:
        """The last word, then the socket closes: stages that joined from other hosts stop
        on it."""
        self.socket.send(Codec.encode(dataclasses.replace(status, stopping=True)))
        self.socket.close()
