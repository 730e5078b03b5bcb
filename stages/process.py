"""What every stage process does at start: name itself, set up logging, watch its parent,
turn SIGTERM into a stop flag, and report ready or failed to the launcher."""

from __future__ import annotations

import logging
import os
import shutil
import signal
import threading
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

import zmq

from ipc.channels import PushChannel
from ipc.messages import Message, StageFailed, StageReady
from stages.trace import Tracer

if TYPE_CHECKING:
    from pipeline.config import PipelineConfig

logger = logging.getLogger(__name__)


def _die_with_parent(parent_pid: int, ctx: StageContext) -> None:
    """Stop when the launcher's process is gone, however it died. (Not PR_SET_PDEATHSIG: it
    fires when the launching *thread* exits, which a short-lived thread would do.)"""

    def watch() -> None:
        while not ctx.stop.wait(0.25):
            if os.getppid() != parent_pid:
                logger.warning("parent %d is gone: stopping", parent_pid)
                ctx.is_orphaned = True
                ctx.stop.set()

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
        self._control = PushChannel(self.zmq, cfg.control_address, bind=False)
        trace = os.path.join(cfg.trace_dir, f"{stage}-{rank}.json") if cfg.trace_dir else None
        self.tracer = Tracer(trace, stage, rank)
        self.run_dir = cfg.run_dir
        self.is_orphaned = False  # the launcher died without stopping us
        _die_with_parent(parent_pid, self)

    def ready(self, **info: int) -> None:
        self._control.send(StageReady(self.stage, self.rank, os.getpid(), dict(info)))

    def report(self, msg: Message) -> None:
        """Send a message to the launcher (stats)."""
        self._control.send(msg)

    def failed(self, message: str) -> None:
        self._control.send(StageFailed(self.stage, self.rank, os.getpid(), message))


@contextmanager
def stage_process(stage: str, rank: int, cfg: PipelineConfig, parent_pid: int
                  ) -> Iterator[StageContext]:
    """Run a stage body: name the process, handle signals, report a crash before dying."""
    from setproctitle import setproctitle

    setproctitle(f"llm-pipeline:{stage}:{rank}")
    setup_logging(stage, rank)
    ctx = StageContext(stage, rank, cfg, parent_pid)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the launcher decides; Ctrl-C reaches it
    signal.signal(signal.SIGTERM, lambda *_: ctx.stop.set())
    try:
        yield ctx
    except BaseException as exc:
        logger.error("stage failed: %s", traceback.format_exc())
        ctx.failed(f"{type(exc).__name__}: {exc}")
        raise SystemExit(1) from None
    finally:
        ctx.tracer.dump()
        ctx.zmq.destroy(linger=1000)
        if ctx.is_orphaned:  # nobody else will remove the run's socket files now
            shutil.rmtree(ctx.run_dir, ignore_errors=True)
