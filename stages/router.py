"""Which data-parallel engine (scheduler + executor pair) each tokenized request goes to.
A pure core with no sockets; each tokenizer worker process holds one EngineRouter.
"""

from __future__ import annotations

import zlib
from collections import OrderedDict
from collections.abc import Sequence
from typing import NamedTuple

from ipc.lora import adapter_id

POLICIES = ("prefix", "load")
# Cache affinity yields to load only when the holder is clearly overloaded, both in absolute
# and in relative terms: the rule of SGLang's cache-aware router (balance_abs_threshold=64
# requests, balance_rel_threshold=1.5). Our load counts tokens, so 64 requests of ~64 tokens.
BALANCE_ABS_TOKENS = 4096
BALANCE_REL = 1.5


class NoEngine(RuntimeError):
    """Every engine is down: the request cannot be placed anywhere."""


class PrefixMatch(NamedTuple):
    num_blocks: int  # leading full blocks of the prompt that some alive engine was sent
    engine_mask: int  # bit e set: alive engine e was sent all of those blocks


def block_keys(prompt_ids: Sequence[int], block_size: int, adapter_id: int = 0) -> list[int]:
    """Chained keys of the prompt's full blocks (the partial last block has none), the chain
    seeded by the request's LoRA adapter id (0: the base model), as the engines' prefix caches
    are: one adapter's blocks are not another's. Python hashes ints and tuples of ints
    without the per-process seed used for str and bytes, so every tokenizer worker computes
    the same keys and learns the same table."""
    keys: list[int] = []
    key = adapter_id
    for start in range(0, len(prompt_ids) - block_size + 1, block_size):
        key = hash((key, tuple(prompt_ids[start:start + block_size])))
        keys.append(key)
    return keys


class EngineRouter:
    """Picks an engine per request from published loads plus what this router added since.

    Invariants: an engine that is not alive is never returned; ties go to the lowest index.
    The table maps block key -> bitmask of engines that were sent that block; it holds at
    most `max_blocks` keys and is owned by this router alone (each worker learns its own).
    """

    def __init__(self, num_engines: int, block_size: int, policy: str = "prefix",
                 max_blocks: int = 1 << 16, lora_names: tuple[str, ...] = ()) -> None:
        if policy not in POLICIES:
            raise ValueError(f"unknown routing policy {policy!r}: expected one of {POLICIES}")
        if num_engines < 1 or block_size < 1 or max_blocks < 1:
            raise ValueError("num_engines, block_size and max_blocks must all be >= 1")
        self.num_engines = num_engines
        self.block_size = block_size
        self.policy = policy
        self.max_blocks = max_blocks
        self.lora_names = lora_names  # the served adapters: a name's id seeds its keys
        self._base = [0] * num_engines  # tokens of work, as last published
        self._added = [0] * num_engines  # tokens routed here since that publication
        self._alive = [True] * num_engines
        self._table: OrderedDict[int, int] = OrderedDict()

    def grow(self, num_engines: int) -> None:
        """Engines joined (from another host): they start empty and alive."""
        extra = num_engines - self.num_engines
        if extra > 0:
            self._base += [0] * extra
            self._added += [0] * extra
            self._alive += [True] * extra
            self.num_engines = num_engines

    @property
    def loads(self) -> tuple[int, ...]:
        """The current estimate: published load plus local additions, per engine."""
        return tuple(b + a for b, a in zip(self._base, self._added, strict=True))

    @property
    def num_blocks(self) -> int:
        return len(self._table)

    def set_loads(self, loads: Sequence[int], alive: Sequence[bool]) -> None:
        """A publication from the engines: replaces the base loads, drops local additions."""
        if len(loads) != self.num_engines or len(alive) != self.num_engines:
            raise ValueError(f"expected {self.num_engines} loads and alive flags, got "
                             f"{len(loads)} and {len(alive)}")
        died = [e for e in range(self.num_engines) if self._alive[e] and not alive[e]]
        if died:
            self._forget(died)
        self._base = [int(x) for x in loads]
        self._added = [0] * self.num_engines
        self._alive = [bool(x) for x in alive]

    def match(self, prompt_ids: Sequence[int], lora_name: str = "") -> PrefixMatch:
        """The deepest leading run of blocks some alive engine holds (keys are chained, so the
        walk stops at the first block no alive engine was sent), under adapter `lora_name`."""
        return self._match(self._keys(prompt_ids, lora_name))

    def _keys(self, prompt_ids: Sequence[int], lora_name: str) -> list[int]:
        served = adapter_id(self.lora_names, lora_name)
        # (an adapter loaded at run time: a seed of its name, past every served id; the
        # router's keys only steer, the engines' caches are keyed by their own ids)
        return block_keys(prompt_ids, self.block_size, served if served is not None
                          else (1 << 32) + zlib.crc32(lora_name.encode()))

    def route(self, prompt_ids: Sequence[int], cost: int, lora_name: str = "") -> int:
        """The engine for this request; `cost` (its tokens of work) joins that engine's load.
        `lora_name`: its LoRA adapter ("": the base model), part of its blocks' keys."""
        alive = [e for e in range(self.num_engines) if self._alive[e]]
        if not alive:
            what = "the engine is" if self.num_engines == 1 else \
                f"all {self.num_engines} engines are"
            raise NoEngine(f"{what} down (being started again after a death, or gone); "
                           "send the request again shortly")
        keys: list[int] = []  # only the prefix policy learns blocks
        if self.num_engines == 1:
            chosen = 0
        elif self.policy == "load":
            chosen = self._least_loaded(alive)
        else:
            keys = self._keys(prompt_ids, lora_name)
            chosen = self._choose_by_prefix(alive, keys)
        self._added[chosen] += cost
        self._remember(keys, chosen)
        return chosen

    def _least_loaded(self, engines: Sequence[int]) -> int:
        loads = self.loads
        return min(engines, key=loads.__getitem__)  # min keeps the first: lowest index wins

    def _choose_by_prefix(self, alive: list[int], keys: list[int]) -> int:
        least = self._least_loaded(alive)
        found = self._match(keys)
        if found.num_blocks == 0:
            return least
        holder = self._least_loaded([e for e in alive if found.engine_mask >> e & 1])
        loads = self.loads
        gap = loads[holder] - loads[least]
        if gap > BALANCE_ABS_TOKENS and loads[holder] > BALANCE_REL * loads[least]:
            return least
        return holder

    def _match(self, keys: list[int]) -> PrefixMatch:
        alive_mask = sum(1 << e for e in range(self.num_engines) if self._alive[e])
        depth, mask = 0, 0
        for key in keys:
            held = self._table.get(key, 0) & alive_mask
            if not held:
                break
            depth, mask = depth + 1, held
        return PrefixMatch(depth, mask)

    def _remember(self, keys: list[int], engine: int) -> None:
        # Deepest block first, so a prompt's leading blocks are the most recent and LRU evicts
        # leaves before the roots that every deeper key is chained to (as a radix cache does).
        bit = 1 << engine
        for key in reversed(keys):
            self._table[key] = self._table.get(key, 0) | bit
            self._table.move_to_end(key)
        while len(self._table) > self.max_blocks:
            self._table.popitem(last=False)

    def _forget(self, engines: list[int]) -> None:
        # A restarted engine has an empty KV cache: it must not be credited with old prefixes.
        # O(table) once per death, which is rare.
        keep = ~sum(1 << e for e in engines)
        for key in list(self._table):
            mask = self._table[key] & keep
            if mask:
                self._table[key] = mask
            else:
                del self._table[key]
