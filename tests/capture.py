"""Raw capture of every frame on every interface of this network namespace, as a sniffer on
the wire would see them (tests/test_remote_stages.py runs it inside a namespace of its own):

    python tests/capture.py OUT_FILE

Writes each frame's bytes to OUT_FILE (appended as they come) until SIGTERM; prints `ready`
once the socket listens. Needs CAP_NET_RAW (root, as `ip netns exec` has)."""

from __future__ import annotations

import signal
import socket
import sys

ETH_P_ALL = 0x0003


def main() -> None:
    out_path = sys.argv[1]
    sniffer = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.ntohs(ETH_P_ALL))
    sniffer.settimeout(0.2)
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(True))
    print("ready", flush=True)
    with open(out_path, "wb") as out:
        while not stop:
            try:
                frame = sniffer.recv(65536)
            except TimeoutError:
                continue
            out.write(frame)
            out.flush()


if __name__ == "__main__":
    main()
