"""A stage's sockets to the other stages it sends to (engines, tokenizer workers,
detokenizer workers), by engine or rank. They start from the run's own addresses and follow
each `Members` the launcher sends when a stage joins from another host or one that joined
leaves (pipeline/runtime/remote.py). Used by the scheduler, the tokenizers, the
detokenizers and the launcher."""

from __future__ import annotations

import logging

import zmq

from ipc.channels import PushChannel
from ipc.config import PipelineConfig
from ipc.messages import Members, Message

logger = logging.getLogger(__name__)


def local_members(cfg: PipelineConfig) -> Members:
    """The stages the launcher starts itself, at their ipc:// addresses (epoch 0)."""
    return Members(0, cfg.scheduler_addresses(),
                   [cfg.tokenizer_stage_address(r) for r in range(cfg.num_tokenizers)],
                   [cfg.detokenizer_address(r) for r in range(cfg.num_detokenizers)],
                   [True] * cfg.num_detokenizers)


class Peers:
    """One PUSH socket per peer address, each frame behind the run's secret. A message for a
    peer that is gone (or not known yet) is not sent: the caller learns it (False)."""

    def __init__(self, zctx: zmq.Context, secret: bytes, members: Members) -> None:
        self._zctx, self._secret = zctx, secret
        self._channels: dict[str, PushChannel] = {}
        self.members = Members(-1, [], [], [], [])
        self.update(members)

    def update(self, members: Members) -> bool:
        """Take a newer roster (an older or repeated one is ignored): connect to new
        addresses, close those no longer in it. True if it was newer."""
        if members.epoch <= self.members.epoch:
            return False
        wanted = {a for a in (*members.engines, *members.tokenizers, *members.detokenizers)
                  if a}
        for address in [a for a in self._channels if a not in wanted]:
            self._channels.pop(address).close()
        for address in wanted - self._channels.keys():
            self._channels[address] = PushChannel(self._zctx, address, bind=False,
                                                  secret=self._secret)
        self.members = members
        return True

    @property
    def num_engines(self) -> int:
        return len(self.members.engines)

    def engine_up(self, engine: int) -> bool:
        return 0 <= engine < len(self.members.engines) and bool(self.members.engines[engine])

    def to_engine(self, engine: int, msg: Message) -> bool:
        return self._send(self.members.engines, engine, msg)

    def to_engines(self, msg: Message) -> None:
        for engine in range(self.num_engines):
            self.to_engine(engine, msg)

    def detokenizer_up(self, rank: int) -> bool:
        detoks = self.members.detokenizers
        return 0 <= rank < len(detoks) and bool(detoks[rank])

    def to_tokenizer(self, rank: int, msg: Message) -> bool:
        return self._send(self.members.tokenizers, rank, msg)

    def to_detokenizer(self, rank: int, msg: Message) -> bool:
        return self._send(self.members.detokenizers, rank, msg)

    def to_detokenizers(self, msg: Message) -> None:
        for rank in range(len(self.members.detokenizers)):
            self.to_detokenizer(rank, msg)

    def detokenizers_for(self, reply_to: str) -> list[int]:
        """The detokenizer ranks that can reach a client's reply address: any for tcp://,
        those on the launcher's host for a local (ipc://) client."""
        m = self.members
        return [r for r, address in enumerate(m.detokenizers)
                if address and (reply_to.startswith("tcp://") or m.local_detokenizers[r])]

    def _send(self, addresses: list[str], index: int, msg: Message) -> bool:
        address = addresses[index] if 0 <= index < len(addresses) else ""
        if not address:
            return False
        self._channels[address].send(msg)
        return True

    def close(self) -> None:
        for chan in self._channels.values():
            chan.close()
        self._channels.clear()
