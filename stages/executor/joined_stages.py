"""Pipeline stages on another host (`--joined-pipeline-stages N`: the last N stages of an
engine run on a host that joins the run with `run_pipeline stage pipeline`). Such a rank maps
none of the engine's shared-memory rings, so what it would read there travels to it:

- **Plans:** the engine's first rank sends each plan with its ring slot's entries
  (RemoteStep, ipc/step.py step_columns) to each joined rank's inbox; the rank writes them into
  a ring of its own and runs the step as a rank on the head's host does.
- **Samples:** a joined sampling rank (the last stage's first) sends each step's samples
  (RemoteSampled, sampled_columns) to the first rank, whose relay thread writes them into
  the sampled-token ring the scheduler reads and passes SampledTokens on, its device times
  moved onto this host's clock.
- **Where each listens:** every rank meets in the engine's TCP store (parallel.engine_store,
  at the rendezvous the launcher gives the engine), which also carries these inboxes'
  tcp:// addresses. The inboxes are ZeroMQ under CURVE (encrypted, and only the run's stages
  get in: ipc/curve.py); the hidden states, the sampled ids going back to the first stage and
  the store itself are torch.distributed's (gloo on the CPU, NCCL on CUDA), in the clear:
  docs/ARCHITECTURE.md says how to keep them on a private network.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time

import torch.distributed as dist
import zmq

from ipc.channels import PullChannel, PushChannel
from ipc.codec import Codec
from ipc.config import PipelineConfig
from ipc.messages import LastStep, Message, RemoteSampled, RemoteStep, SampledTokens, StepPlan
from ipc.shm import SharedRing
from ipc.step import put_columns, sampled_columns, step_columns

logger = logging.getLogger(__name__)

SAMPLES_KEY = "samples"  # the store's key of the first rank's inbox for joined samples


def plans_key(rank: int) -> str:
    """The store's key of a joined rank's inbox for plans (its rank within the engine)."""
    return f"plans-{rank}"


def bind_inbox(ctx: zmq.Context, cfg: PipelineConfig, codec: Codec) -> tuple[PullChannel, str]:
    """An inbox on a tcp:// port of this host (under CURVE: only the run's stages connect)
    and the address its peers reach it at."""
    chan = PullChannel(ctx, f"tcp://{cfg.remote.listen_host}:0", codec, bind=True,
                       secret=cfg.keys.run_secret)
    return chan, f"tcp://{cfg.remote.listen_host}:{chan.port}"


def lookup(store: dist.Store, key: str) -> str:
    """A peer's address from the engine's store (waits for it, up to the store's timeout)."""
    return store.get(key).decode()


class JoinedFollower:
    """The first rank's link to one joined rank: what it forwards (a plan, LastStep) goes
    with the plan's ring slot entries."""

    def __init__(self, ctx: zmq.Context, cfg: PipelineConfig, address: str,
                 steps: SharedRing) -> None:
        self.steps = steps
        self.chan = PushChannel(ctx, address, bind=False, secret=cfg.keys.run_secret)

    def send(self, msg: Message) -> None:
        if isinstance(msg, StepPlan):
            msg = RemoteStep(msg, step_columns(self.steps.slot(msg.ring_slot), msg))
        self.chan.send(msg)


def plans_codec(joined: bool) -> Codec:
    """What a follower rank's inbox takes: plans (with their slots' entries, RemoteStep, on a
    joined host) and LastStep."""
    return Codec([RemoteStep if joined else StepPlan, LastStep])


def unpack_plan(msg: RemoteStep, steps: SharedRing) -> None:
    """A joined rank: a RemoteStep's entries written into its own ring slot."""
    put_columns(steps.slot(msg.plan.ring_slot), msg.columns)


def joined_samples(tokens: SampledTokens, sampled: SharedRing, num_rows: int) -> RemoteSampled:
    """A joined sampling rank's report of a step: the tokens and the slot's entries."""
    return RemoteSampled(tokens, sampled_columns(sampled.slot(tokens.ring_slot), tokens,
                                                 num_rows))


class SamplesRelay:
    """The first rank's thread that takes a joined sampling rank's RemoteSampled, writes its
    entries into the engine's sampled-token ring and passes the SampledTokens on to the
    scheduler. Its sockets (`inbox`, handed over, and the one to the scheduler) are used and
    closed by the thread alone."""

    def __init__(self, ctx: zmq.Context, cfg: PipelineConfig, inbox: PullChannel,
                 sampled: SharedRing) -> None:
        self.ctx, self.cfg, self.inbox, self.sampled = ctx, cfg, inbox, sampled
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="samples-relay", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        out = PushChannel(self.ctx, self.cfg.sampled_address, bind=False,
                          secret=self.cfg.keys.run_secret)
        try:
            while not self._stop.is_set():
                msg = self.inbox.recv_foreign_safe(timeout_ms=100)
                if msg is None:
                    continue
                assert isinstance(msg, RemoteSampled)
                out.send(self._relay(msg))
        except zmq.ContextTerminated:
            pass
        except BaseException as exc:  # the host loop raises it: the rank fails
            self.error = exc
            logger.exception("relaying a joined stage's samples failed")
        finally:
            out.close()
            self.inbox.close()

    def _relay(self, msg: RemoteSampled) -> SampledTokens:
        put_columns(self.sampled.slot(msg.tokens.ring_slot), msg.columns)
        tokens = msg.tokens  # (device times by the other host's clock: moved onto this one's)
        end = time.monotonic()
        return dataclasses.replace(tokens, device_end=end,
                                   device_start=end - (tokens.device_end - tokens.device_start))

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
