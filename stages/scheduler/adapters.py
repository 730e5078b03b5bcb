"""Which LoRA adapters the executor holds, in the scheduler process: the adapter id of each
request's adapter and, where adapters are swapped (more --lora-modules than --max-loras, or
adapters loaded at run time: POST /v1/load_lora_adapter), the executor's slots: an adapter
is loaded as its requests are admitted and evicted, least recently used, once idle.

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
    """The adapter ids (`id_of`) and the executor's slots (`take`): at most `num_slots`
    adapters resident (0: no swapping, the --lora-modules adapters of `names` and `paths`
    stay loaded), a slot freed only from an adapter no running sequence uses, so rows of
    one adapter never run under another's weights."""

    def __init__(self, names: tuple[str, ...], paths: tuple[str, ...], num_slots: int
                 ) -> None:
        self.names, self.paths, self.num_slots = names, paths, num_slots
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
        if not self.num_slots:  # (every adapter is loaded at start: none is swapped)
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
        static = adapter <= len(self.names)  # (an adapter of --lora-modules)
        load = LoraLoad(adapter, params.lora_name,
                        self.paths[adapter - 1] if static else params.lora_path)
        self.resident[adapter] = load
        loads.append(load)
        return True
