"""Which stages make up a running pipeline, where each listens, and how a stage on another
host joins it (pipeline/runtime/remote.py is the joining side). Runs in the launcher.

The join is two requests on the launcher's bootstrap socket (the one remote clients ask for
the endpoints), with the stage key that the launcher was started with (--stage-key):

  hello                       -> a fresh random challenge
  join {kind, host, model fingerprint, challenge, proof = HMAC(key, challenge...), nonce}
                              -> {engine or rank, the run's config and id, the roster,
                                  where to report, proof = HMAC(key, nonce + answer)}

Both sides prove they hold the key; the run's secret is derived from it on each side
(ipc.keys.derive_run_secret), so it never crosses the network in a join. The joined stage
reports ready to the launcher's control socket over tcp://, and from then on a heartbeat
(StageAlive); one silent for REMOTE_SILENCE_S has left. Every change of the roster reaches
every stage as a `Members` message.
"""

from __future__ import annotations

import hmac
import json
import logging
import re
import secrets
from dataclasses import dataclass

from ipc.config import PipelineConfig
from ipc.keys import proof
from ipc.messages import Members

logger = logging.getLogger(__name__)

REMOTE_SILENCE_S = 5.0  # a joined stage that sends nothing for this long has left
HEARTBEAT_S = 1.0  # how often a joined stage says it runs (StageAlive)
CHALLENGE_TTL_S = 30.0  # a challenge not answered by then is void
# (a "pipeline" host runs an engine's joined pipeline stages: --joined-pipeline-stages)
JOIN_KINDS = ("engine", "tokenizer", "detokenizer", "pipeline")
_HOST = re.compile(r"[A-Za-z0-9][A-Za-z0-9.-]{0,252}")  # a host name or an IPv4 address
_HEX = re.compile(r"[0-9a-f]{64}")


class JoinError(RuntimeError):
    """A stage could not join: the message says why (and what to do)."""


def kind_of(stage: str) -> str:
    """The roster's kind of a stage process: a scheduler stands for its engine."""
    return "engine" if stage == "scheduler" else stage


def stage_of(kind: str) -> str:
    """The stage process that stands for a roster kind: an engine's is its scheduler."""
    return "scheduler" if kind == "engine" else kind


@dataclass
class Member:
    """A stage the roster names: an engine (its scheduler's inbox) or a worker."""

    kind: str  # "engine", "tokenizer" or "detokenizer"
    index: int  # the engine, or the worker's rank
    local: str  # its ipc:// inbox, for stages on the launcher's host ("" if joined)
    tcp: str = ""  # its tcp:// inbox, once known (with stages on other hosts only)
    client: str = ""  # a joined one's tcp:// inbox from clients (requests; aborts)
    joined: bool = False  # it joined from another host
    ready: bool = False
    gone: bool = False
    last_seen: float = 0.0
    leaving: str = ""  # a joined one said it stops, and why (StageLeaving)

    @property
    def name(self) -> str:
        return f"{stage_of(self.kind)}:{self.index}"


class Roster:
    """The members, and what each stage is told of them. Pure: no sockets."""

    def __init__(self, cfg: PipelineConfig, public_host: str) -> None:
        self.cfg, self.public_host = cfg, public_host
        self.epoch = 0
        self.members: dict[tuple[str, int], Member] = {}
        for e in range(cfg.data_parallel_size):
            self._add(Member("engine", e, cfg.for_engine(e).scheduler_address, ready=True))
        for r in range(cfg.num_tokenizers):
            self._add(Member("tokenizer", r, cfg.tokenizer_stage_address(r), ready=True))
        for r in range(cfg.num_detokenizers):
            self._add(Member("detokenizer", r, cfg.detokenizer_address(r), ready=True))
        self._challenges: dict[str, float] = {}  # challenge -> when it was handed out

    def _add(self, member: Member) -> None:
        self.members[(member.kind, member.index)] = member

    def of_kind(self, kind: str) -> list[Member]:
        return sorted((m for m in self.members.values() if m.kind == kind),
                      key=lambda m: m.index)

    def local_ready(self, kind: str, index: int, stage_port: int) -> None:
        """A stage the launcher started is ready; with stages on other hosts, it also
        listens on stage_port."""
        if stage_port:
            self.members[(kind, index)].tcp = f"tcp://{self.public_host}:{stage_port}"

    # ------------------------------------------------------------ what stages are told

    def view(self, joined: bool) -> Members:
        """The roster as a stage on the launcher's host (ipc:// where it can) or on
        another host (tcp:// everywhere) sends to it."""

        def address(m: Member) -> str:
            if m.gone or not m.ready:
                return ""
            return m.tcp if (joined or m.joined) else m.local

        detoks = self.of_kind("detokenizer")
        return Members(self.epoch, [address(m) for m in self.of_kind("engine")],
                       [address(m) for m in self.of_kind("tokenizer")],
                       [address(m) for m in detoks], [not m.joined for m in detoks])

    def recipients(self) -> list[tuple[Member, Members]]:
        """Each serving member with the roster as it must see it."""
        views = {False: self.view(False), True: self.view(True)}
        return [(m, views[m.joined]) for m in self.members.values() if m.ready and not m.gone]

    # ------------------------------------------------------------ joining

    def challenge(self, now: float) -> str:
        for old in [c for c, t in self._challenges.items() if now - t > CHALLENGE_TTL_S]:
            del self._challenges[old]
        challenge = secrets.token_hex(16)
        self._challenges[challenge] = now
        return challenge

    def join(self, request: dict[str, object], key: str, fingerprint: str, now: float,
             public: dict[str, str], host_for: int | None = None) -> dict[str, object]:
        """Admit a stage (JoinError if not): its engine or rank, and what it runs with.
        public: where it reaches the launcher ("control", "status"); host_for: the engine a
        joining "pipeline" host runs the joined stages of (None: none waits for one)."""
        fields = ("kind", "host", "challenge", "nonce", "proof", "fingerprint")
        if not all(isinstance(request.get(k), str) for k in fields):
            raise JoinError(f"a join request names {', '.join(fields)}, each a string")
        kind, host, challenge, nonce, their_proof, their_model = (str(request[k])
                                                                   for k in fields)
        if self._challenges.pop(challenge, None) is None:
            raise JoinError("the challenge is unknown or expired: join again")
        if not (_HEX.fullmatch(their_proof) and hmac.compare_digest(
                their_proof, proof(key, "join", kind, host, challenge))):
            raise JoinError("wrong stage key (give the one the pipeline was started with: "
                            "--stage-key or $LLM_PIPELINE_STAGE_KEY)")
        if kind not in JOIN_KINDS:
            raise JoinError(f"cannot join as {kind!r}: one of {', '.join(JOIN_KINDS)}")
        if not _HOST.fullmatch(host):
            raise JoinError(f"{host!r} is not a host name or an IPv4 address")
        if their_model != fingerprint:
            raise JoinError("the model folder differs from the pipeline's (its config.json or "
                            "tokenizer.json): give --model a copy of the same model")
        joined_stages = self.cfg.executor.joined_pipeline_stages
        if kind == "pipeline" and host_for is None:
            raise JoinError("no engine of this pipeline waits for the host of its pipeline "
                            "stages" + ("" if joined_stages else
                                        ": it was not started with --joined-pipeline-stages"))
        if kind == "engine" and joined_stages:
            raise JoinError("an engine cannot join a pipeline started with "
                            "--joined-pipeline-stages (join its pipeline stages: run_pipeline "
                            "stage pipeline)")
        # (a pipeline host's index is its own, never reused: one that was counted gone and
        # comes back is not taken for its successor; "engine" says whose stages it runs)
        index = 1 + max((m.index for m in self.of_kind(kind)), default=-1)
        self._add(Member(kind, index, "", joined=True, last_seen=now + self.cfg.ready_timeout_s))
        self.members[(kind, index)].tcp = host  # the host only, until it reports its port
        engine = {"engine": host_for} if kind == "pipeline" else {}
        answer = {"index": index, **engine, "run_id": self.cfg.run_id,
                  "config": self.cfg.to_wire(),
                  "members": list(_fields(self.view(True))), **public}
        body = json.dumps(answer, sort_keys=True)
        return {"answer": body, "proof": proof(key, "answer", nonce, body)}

    def answer(self, frames: list[bytes], key: str, fingerprint: str, now: float,
               public: dict[str, str], host_for: int | None = None
               ) -> tuple[bytes, Member | None]:
        """The bootstrap socket's answer to a joining stage's `hello` or `join` frames, and
        the member a join admitted (None otherwise)."""
        if frames == [b"hello"]:
            return self.challenge(now).encode(), None
        before = set(self.members)
        try:
            if len(frames) != 2 or frames[0] != b"join":
                raise JoinError("not a join request")
            request = json.loads(frames[1])
            if not isinstance(request, dict):
                raise JoinError("not a join request")
            reply = self.join(request, key, fingerprint, now, public, host_for)
        except JoinError as exc:
            return json.dumps({"error": str(exc)}).encode(), None
        except Exception as exc:  # whatever anyone sends, the supervisor goes on
            logger.warning("refused a malformed join request: %s: %s", type(exc).__name__, exc)
            return json.dumps({"error": "a malformed join request"}).encode(), None
        (added,) = set(self.members) - before
        return json.dumps(reply).encode(), self.members[added]

    def joined_ready(self, kind: str, index: int, info: dict[str, int], now: float) -> bool:
        """A joined stage reported ready (its ports); False if the roster does not await it."""
        member = self.members.get((kind, index))
        if member is None or not member.joined or member.ready or member.gone:
            return False
        ports = [info.get("stage_port"), info.get("tcp_port", 1)]
        if not all(isinstance(p, int) and 0 < p < 65536 for p in ports):
            logger.warning("%s reported ready without its ports (%s): it is not taken",
                           member.name, info)
            self.leave(member)
            return False
        host = member.tcp
        member.tcp = f"tcp://{host}:{info['stage_port']}"
        if "tcp_port" in info:
            member.client = f"tcp://{host}:{info['tcp_port']}"
        member.ready, member.last_seen = True, now
        self.epoch += 1
        return True

    def seen(self, kind: str, index: int, now: float) -> None:
        member = self.members.get((kind, index))
        if member is not None and member.joined:
            member.last_seen = max(member.last_seen, now)

    def said_leaving(self, kind: str, index: int, why: str) -> None:
        """A joined stage said it stops: the next `silent` counts it gone."""
        member = self.members.get((kind, index))
        if member is not None and member.joined and not member.gone:
            member.leaving = why or "it stopped"

    def silent(self, now: float) -> list[Member]:
        """Joined members not heard from for REMOTE_SILENCE_S (or, before ready, within the
        ready timeout), or that said they stop: each is marked gone and the epoch moves on."""
        lost = [m for m in self.members.values() if m.joined and not m.gone
                and (m.leaving or now - m.last_seen > REMOTE_SILENCE_S)]
        for member in lost:
            self.leave(member)
        return lost

    def leave(self, member: Member) -> None:
        if not member.gone:
            member.gone = True
            self.epoch += 1

    def back(self, kind: str, index: int) -> None:
        """A local stage that left (an engine that died) serves again: it was started anew."""
        member = self.members[(kind, index)]
        if member.gone:
            member.gone = False
            self.epoch += 1

    def left(self) -> list[str]:
        """The names of joined stages that have left (or never got ready)."""
        return sorted(m.name for m in self.members.values() if m.joined and m.gone)

    def joined_addresses(self) -> dict[str, str]:
        """For clients: each serving joined tokenizer's and engine's tcp:// inbox."""
        return {m.name: m.client for m in self.members.values()
                if m.joined and m.ready and not m.gone and m.client}


def _fields(members: Members) -> tuple[object, ...]:
    return (members.epoch, members.engines, members.tokenizers, members.detokenizers,
            members.local_detokenizers)

