"""Every socket address and shared-memory ring name of one run, derived from the config so
that two runs (or two engines of one run) never collide. Mixed into PipelineConfig; read by
every stage and the launcher.

- A stage's inbox is `ipc://<run dir>/<name>.sock`: the run directory is unique to the run.
- The sockets and rings of one engine (scheduler, executor, sampled, abort, the step rings)
  carry the suffix `-e<engine>` for engines after the first; engine 0 keeps the plain names.
- Rings are named `llm-pipeline-<run id>[-e<engine>]-step` and `...-sampled` (the run id is
  unique, and shared memory has no directory to hold them).
- tcp:// is for other hosts only: with --listen, inboxes also bind a tcp:// port on the listen
  host (ipc/channels.py: listen_tcp, stage_listen) and report it when ready; a stage that
  joined from another host reaches the launcher's status publisher at
  `remote.launcher_status`, and only with --listen may outputs go to a client's tcp:// reply
  socket (is_client_address).
"""

from __future__ import annotations

import fcntl
import socket
import struct
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True, kw_only=True)
class RemoteSettings:
    """How one host's stages meet other hosts (PipelineConfig.remote): each host's own, never
    sent to a stage that joins."""

    listen_host: str = ""  # --listen: also take clients (and stages) over tcp:// on this host
    # In a stage that joined from another host: the launcher's tcp:// status publisher.
    launcher_status: str = ""


class RunAddresses:
    """The addresses and ring names of one stage's view of the run: its engine's (`engine`)
    and the run-wide ones. Reads only the fields below, which the config defines."""

    run_dir: str
    run_id: str
    engine: int
    remote: RemoteSettings

    def address(self, name: str) -> str:
        return f"ipc://{Path(self.run_dir) / name}.sock"

    def engine_address(self, name: str) -> str:
        """An address of this config's engine (engine 0 keeps the plain names)."""
        return self.address(f"{name}{self._engine_suffix}")

    @property
    def _engine_suffix(self) -> str:
        return f"-e{self.engine}" if self.engine else ""

    def tokenizer_address(self, rank: int) -> str:
        return self.address(f"tokenizer-{rank}")

    def tokenizer_stage_address(self, rank: int) -> str:
        """Tokenizer `rank`'s inbox from the other stages (the engines' ReconcileAnswer)."""
        return self.address(f"tokenizer-{rank}-stages")

    @property
    def scheduler_address(self) -> str:
        """The scheduler's inbox from the other stages (secret frames only)."""
        return self.engine_address("scheduler")

    @property
    def abort_address(self) -> str:
        """The scheduler's inbox from clients: AbortRequest only."""
        return self.engine_address("abort")

    @property
    def client_reply_prefix(self) -> str:
        """Where a local client binds its reply socket: this prefix, a name, then `.sock`."""
        return f"ipc://{Path(self.run_dir) / 'client-'}"

    def is_client_address(self, address: str) -> bool:
        """Whether outputs may be sent to `address`: a client's reply socket in the run
        directory, or (with --listen) a remote client's tcp:// one; never a stage's socket."""
        if address.startswith("tcp://"):
            return bool(self.remote.listen_host)
        prefix = self.client_reply_prefix
        return (address.startswith(prefix) and address.endswith(".sock")
                and "/" not in address[len(prefix):])

    @property
    def status_address(self) -> str:
        return self.remote.launcher_status or self.address("status")

    def detokenizer_address(self, rank: int) -> str:
        return self.address(f"detokenizer-{rank}")

    @property
    def executor_address(self) -> str:
        return self.engine_address("executor")

    @property
    def sampled_address(self) -> str:
        return self.engine_address("sampled")

    @property
    def control_address(self) -> str:
        return self.address("control")

    @property
    def step_ring_name(self) -> str:
        return f"llm-pipeline-{self.run_id}{self._engine_suffix}-step"

    @property
    def sampled_ring_name(self) -> str:
        return f"llm-pipeline-{self.run_id}{self._engine_suffix}-sampled"


def interface_of(host: str) -> str:
    """The network interface that holds `host`'s IPv4 address on this host (gloo listens
    there, across hosts, as its executor ranks), or ValueError naming the address."""
    try:
        address = socket.gethostbyname(host)
    except OSError as exc:
        raise ValueError(f"{host!r} does not resolve to an address: {exc}") from None
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        for _, name in socket.if_nameindex():
            try:  # SIOCGIFADDR: the interface's IPv4 address
                packed = fcntl.ioctl(probe.fileno(), 0x8915,
                                     struct.pack("256s", name.encode()[:15]))
            except OSError:  # (an interface without one)
                continue
            if socket.inet_ntoa(packed[20:24]) == address:
                return name
    raise ValueError(f"no network interface of this host has the address {address} "
                     f"({host}): give --listen an address of this host's")
