"""The engine-restart state machine's actions: an engine whose scheduler or executor rank died
is taken down (its other processes stopped, its requests failed), then started again through
EngineRestart's phases (stopping -> joining -> loading -> starting -> serving; "joining" waits
for the host of its joined pipeline stages, if it has any); engines.py decides what a death
means, supervisor.py runs the processes. Runs in the launcher's supervisor thread."""

from __future__ import annotations

import logging
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ipc.messages import EngineDown
from pipeline.runtime.engines import EngineRestart, Engines
from pipeline.runtime.roster import Roster
from pipeline.runtime.supervisor import Supervisor
from stages.peers import Peers

logger = logging.getLogger(__name__)

# An engine's old processes get this long to stop after SIGTERM before they are killed (the
# new ones bind the same addresses and rings).
ENGINE_STOP_TIMEOUT_S = 5.0
NO_MESSAGE = "no message"


def free_address(host: str) -> str:
    """HOST:PORT of a port free on this host now (an engine's TCP store binds it next)."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        return f"{host}:{sock.getsockname()[1]}"


class LastFailure:
    """The latest StageFailed's message: the next death put in words says it (once)."""

    def __init__(self) -> None:
        self.message = NO_MESSAGE

    def take(self) -> str:
        message, self.message = self.message, NO_MESSAGE
        return message


class EngineRestarts:
    """Takes engines down and starts them again. announce(links): every stage learns the
    roster (the launcher's, after a change)."""

    def __init__(self, supervisor: Supervisor, engines: Engines, roster: Roster,
                 last_failure: LastFailure, announce: Callable[[Peers], None],
                 public_host: str = "") -> None:
        """public_host: where a joined host reaches this one (the engines' TCP stores)."""
        self.supervisor, self.engines, self.roster = supervisor, engines, roster
        self.last_failure, self._announce = last_failure, announce
        self.public_host = public_host

    @property
    def _procs(self) -> dict[str, Any]:
        return self.supervisor.procs

    def take_down(self, engine: int, name: str, links: Peers, cause: str = "") -> str:
        """Engine `engine` lost `name`: stop its other processes, and have the detokenizers
        fail its requests (the tokenizers fail those sent to it lately: see the status).
        What died, in words (`cause`, if given)."""
        how = (f"exit code {self._procs[name].exitcode}" if name in self._procs
               else "on the host of its pipeline stages" if name.startswith("executor:")
               else "it joined from another host and went silent")
        cause = cause or f"{name} died, {how}: {self.last_failure.take()}"
        self.engines.down_why[str(engine)] = cause
        message = f"engine {engine} stopped ({cause}) while it held this request; send it again"
        logger.error("stage %s died: engine %d is down; %d engine(s) still serve", name,
                     engine, self.engines.serving_besides(engine))
        self.engines.take_down(engine)
        self.roster.leave(self.roster.members[("engine", engine)])
        self.stop_engine(engine)
        links.to_detokenizers(EngineDown(engine, message, self.engines.incarnation[engine]))
        self._announce(links)
        return cause

    def stop_engine(self, engine: int) -> None:
        for other in self.engines.processes(engine):
            if other in self._procs:  # (not: an engine on another host)
                self.supervisor.terminate(other)

    def died(self, engine: int, name: str, links: Peers) -> bool:
        """A process of engine `engine` died: take the engine down (if it served) and start
        it again after the restart policy's delay; one that keeps dying stays down while
        another engine serves. False: it was the last, the pipeline fails."""
        action, delay = self.engines.after_death(
            engine, lambda: self.supervisor.restarts.delay(f"engine:{engine}"))
        host = self.engines.hosts.get(engine)
        if action in ("down", "fail") and host is not None and name not in self._procs:
            # (its joined ranks keep dying: the host is sent away, and the engine waits for
            # another, as when a host leaves; the pipeline does not fail over one host)
            self.roster.leave(self.roster.members[("pipeline", int(host.split(":")[1]))])
            self.host_left(engine, host, f"its ranks keep dying ({name})", links)
            return True
        if action in ("ignore", "fail"):
            return action == "ignore"
        if self.engines.alive[engine]:
            cause = self.take_down(engine, name, links)
        else:  # a new process died while the engine was starting again
            how = (f"exit code {self._procs[name].exitcode}" if name in self._procs
                   else "on the host of its pipeline stages")
            cause = f"{name} died while starting again, {how}: {self.last_failure.take()}"
            self.engines.down_why[str(engine)] = cause
            self.stop_engine(engine)
        if action == "down":
            logger.error("engine %d keeps dying (%s): it stays down", engine, cause)
            return True
        now = time.monotonic()
        self.engines.restarting[engine] = EngineRestart(
            cause, now, now + delay, self.engines.incarnation[engine] + 1)
        logger.error("engine %d is starting again in %.1f s (%s)", engine, delay, cause)
        return True

    def advance(self) -> None:
        """Engines whose old processes have stopped and whose delay is over load again (one
        with joined pipeline stages once their host has joined: it waits "joining")."""
        now = time.monotonic()
        for engine, restart in self.engines.restarting.items():
            if restart.phase == "stopping" and self._stopped(engine, restart, now) \
                    and now >= restart.due:
                restart.phase = "joining"
            if restart.phase == "joining" and (not self.engines.layout.joined_stages
                                               or engine in self.engines.hosts):
                self._load(engine)
                restart.phase = "loading"

    def host_left(self, engine: int, name: str, why: str, links: Peers) -> None:
        """The host of engine `engine`'s joined pipeline stages left: the engine goes down
        (if it served) and waits for another host to join."""
        restart = self.engines.restarting.get(engine)
        incarnation = restart.incarnation if restart is not None \
            else self.engines.incarnation[engine] + 1
        cause = (f"the host of its pipeline stages ({name}) left: {why}; waiting for another "
                 "to join")
        if self.engines.alive[engine]:
            self.take_down(engine, name, links, cause)
        else:
            self.stop_engine(engine)
        self.engines.await_host(engine, cause, time.monotonic(), incarnation)

    def _stopped(self, engine: int, restart: EngineRestart, now: float) -> bool:
        """Whether the engine's old processes have all stopped; those still running past
        ENGINE_STOP_TIMEOUT_S are killed."""
        running = [n for n in self.engines.processes(engine)
                   if n in self._procs and self._procs[n].is_alive()]
        if running and now - restart.began > ENGINE_STOP_TIMEOUT_S:
            for n in running:
                logger.warning("%s did not stop in %.0f s: killing it", n,
                               ENGINE_STOP_TIMEOUT_S)
                self._procs[n].kill()
        return not running

    def _load(self, engine: int) -> None:
        """Start the engine's executor ranks anew: the rings and the tensor-parallel store of
        the dead ones are removed first (the new ones are made under the same names)."""
        sup = self.supervisor
        assert sup.cfg is not None  # (the launcher's supervisor has the run's)
        sup.unlink_rings([engine])
        Path(sup.cfg.run_dir, f"tp-store-{engine}").unlink(missing_ok=True)
        for n in self.engines.processes(engine):
            if n in self._procs:
                sup.ready.pop(n, None)
        rendezvous = ""
        if self.engines.layout.joined_stages:  # (the joined host starts its ranks on it)
            old = self.engines.rendezvous.get(engine)
            while (rendezvous := free_address(self.public_host)) == old:
                pass  # (a new one: the host tells a new start from the last by it)
            self.engines.rendezvous[engine] = rendezvous
        sup.spawn_executors(engine, rendezvous)

    def stage_ready(self, engine: int, name: str, info: dict[str, Any], links: Peers) -> None:
        """A new process of a restarting engine is ready: once its head executor rank is
        (its cache allocated), the scheduler starts; once that is, the engine serves."""
        restart = self.engines.restarting[engine]
        self.supervisor.ready[name] = info
        if name == f"executor:{self.engines.layout.head(engine)}" and restart.phase == "loading":
            self.supervisor.spawn_stage("scheduler", engine, info["num_kv_blocks"],
                                        self.roster.view(False), restart.incarnation)
            restart.phase = "starting"
        elif name.startswith("scheduler:") and restart.phase == "starting":
            self.supervisor.unlink_rings([engine])  # both users have them mapped
            self.engines.back(engine)
            self.engines.down_why.pop(str(engine), None)
            self.roster.local_ready("engine", engine, info.get("stage_port", 0))
            self.roster.back("engine", engine)
            self._announce(links)
            logger.warning("engine %d serves again, %.1f s after %s", engine,
                           time.monotonic() - restart.began, restart.cause)
