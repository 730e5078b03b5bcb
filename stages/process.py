"""What every stage process does at start: name itself, set up logging, watch its parent,
turn SIGTERM into a stop flag, and report ready or failed to the launcher."""

from __future__ import annotations

import logging
import os
import shutil
import signal
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import zmq

from ipc import curve
from ipc.channels import PushChannel
from ipc.config import PipelineConfig
from ipc.messages import Message, StageFailed, StageReady
from stages.trace import Tracer

logger = logging.getLogger(__name__)


def watch_parent(parent_pid: int, on_gone: Callable[[], None],
                 is_done: Callable[[], bool]) -> None:
    """Call on_gone once the process that started this one is gone, however it died, unless
    is_done() first. (Not PR_SET_PDEATHSIG: it fires when the launching *thread* exits,
    which a short-lived thread would do.) Stages and the HTTP workers use it."""

    def watch() -> None:
        while not is_done():
            if os.getppid() != parent_pid:
                logger.warning("parent %d is gone: stopping", parent_pid)
                on_gone()
                return
            time.sleep(0.25)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def setup_logging(stage: str, rank: int) -> None:
    level = os.environ.get("LLM_PIPELINE_LOG_LEVEL", "WARNING").upper()
    if not isinstance(logging.getLevelName(level), int):
        level = "WARNING"
    logging.basicConfig(
        level=level,
        format=f"%(asctime)s %(levelname)s [{stage}:{rank} pid=%(process)d] %(name)s: %(message)s",
    )


class StageContext:
    """Handed to a stage's main loop: the stop flag and the channel to the launcher."""

    def __init__(self, stage: str, rank: int, cfg: PipelineConfig, parent_pid: int) -> None:
        self.stage, self.rank = stage, rank
        self.stop = threading.Event()
        self.zmq = zmq.Context()
        keys = cfg.curve_keys()
        if keys is not None:  # tcp:// endpoints under CURVE (with --listen)
            curve.install(self.zmq, keys)
        self._control = PushChannel(self.zmq, cfg.control_address, bind=False,
                                    secret=cfg.keys.run_secret)
        trace = os.path.join(cfg.trace_dir, f"{stage}-{rank}.json") if cfg.trace_dir else None
        self.tracer = Tracer(trace, stage, rank)
        self.run_dir = cfg.run_dir
        self.is_orphaned = False  # the launcher died without stopping us
        watch_parent(parent_pid, self._orphaned, self.stop.is_set)

    def _orphaned(self) -> None:
        self.is_orphaned = True
        self.stop.set()

    def ready(self, **info: int) -> None:
        self._control.send(StageReady(self.stage, self.rank, os.getpid(), dict(info)))

    def report(self, msg: Message) -> None:
        """Send a message to the launcher (stats)."""
        self._control.send(msg)

    def failed(self, message: str) -> None:
        self._control.send(StageFailed(self.stage, self.rank, os.getpid(), message))


@contextmanager
def stage_process(stage: str, rank: int, cfg: PipelineConfig, parent_pid: int,
                  detail: str = "") -> Iterator[StageContext]:
    """Run a stage body: name the process (`detail`: after its name, an executor rank's place
    in its engine), handle signals, report a crash before dying."""
    from setproctitle import setproctitle

    setproctitle(f"llm-pipeline:{stage}:{rank}" + (f" {detail}" if detail else ""))
    setup_logging(stage, rank)
    ctx = StageContext(stage, rank, cfg, parent_pid)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the launcher decides; Ctrl-C reaches it
    signal.signal(signal.SIGTERM, lambda *_: ctx.stop.set())
    try:
        yield ctx
    except BaseException as exc:
        if logger.isEnabledFor(logging.DEBUG):
            logger.error("stage failed: %s", traceback.format_exc())
        else:  # the launcher says it in one line too; the traceback is for --debug
            logger.error("stage failed: %s: %s (the traceback: --debug, or "
                         "LLM_PIPELINE_LOG_LEVEL=DEBUG)", type(exc).__name__, exc)
        ctx.failed(f"{type(exc).__name__}: {exc}")
        raise SystemExit(1) from None
    finally:
        ctx.tracer.dump()
        curve.destroy(ctx.zmq, linger=1000)
        if ctx.is_orphaned:  # nobody else will remove the run's files now
            shutil.rmtree(ctx.run_dir, ignore_errors=True)
            from ipc.step import StepRings  # (numpy: not for every importer of this module)

            StepRings.unlink_names(cfg)  # a launcher that died in start-up had not yet
