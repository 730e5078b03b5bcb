"""Which LoRA adapters the executor holds, in the scheduler process: the adapter id of each
request's adapter, and the slots of adapters loaded at run time (POST /v1/load_lora_adapter),
swapped in as their requests are admitted and out, least recently used, when idle.

Ids: an adapter of --lora-modules is id i + 1 for ever (resident from the executor's start);
an adapter loaded at run time takes a new id for each (name, folder) the scheduler sees,
never reused in this scheduler's life, which is its prefix cache's: a block's key is seeded
by its adapter's id (sequence.py adapter_seed), so a reused id could serve one adapter's KV
to another."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

from ipc.lora import adapter_id
from ipc.messages import LoraLoad, SamplingParams


class AdapterSlots:
    """The adapter ids (`id_of`) and the executor's runtime slots (`take`): at most
    `num_slots` runtime adapters resident, a slot freed only from an adapter no running
    sequence uses, so rows of one adapter never run under another's weights."""

    def __init__(self, names: tuple[str, ...], num_slots: int) -> None:
        self.names, self.num_slots = names, num_slots
        self._ids: dict[tuple[str, str], int] = {}  # (name, folder) -> id, never reused
        self._next_id = len(names) + 1
        self.resident: OrderedDict[int, LoraLoad] = OrderedDict()  # least recent first

    def id_of(self, params: SamplingParams) -> int | None:
        """The adapter id `params` runs under (0: the base model; None: a name not served)."""
        if not params.lora_path:
            return adapter_id(self.names, params.lora_name)
        key = (params.lora_name, params.lora_path)
        if key not in self._ids:
            self._ids[key] = self._next_id
            self._next_id += 1
        return self._ids[key]

    def take(self, adapter: int, params: SamplingParams, running: Iterable[int],
             loads: list[LoraLoad], evictions: list[int]) -> bool:
        """Make `adapter` resident for a sequence being admitted: True when it is (a load,
        and the eviction that made room, appended to the step's `loads` and `evictions`),
        False when every slot holds an adapter that a running sequence (ids `running`) uses:
        the sequence waits."""
        if adapter <= len(self.names):  # (the base model or an adapter of --lora-modules)
            return True
        if adapter in self.resident:
            self.resident.move_to_end(adapter)
            return True
        if len(self.resident) >= self.num_slots:
            busy = set(running)
            idle = next((a for a in self.resident if a not in busy), None)
            if idle is None:
                return False
            del self.resident[idle]
            evictions.append(idle)
        load = LoraLoad(adapter, params.lora_name, params.lora_path)
        self.resident[adapter] = load
        loads.append(load)
        return True
