"""Entry of one HTTP front-end worker process, and the listening socket they all share."""

from __future__ import annotations

import json
import logging
import os
import socket
from pathlib import Path
from typing import Any

import uvicorn

from ipc.config import ServerOptions
from pipeline.runtime.client import PipelineClient
from pipeline.server.app import FrontEnd
from stages.process import watch_parent


def listening_socket(host: str, port: int) -> socket.socket:
    """The one listening socket, bound by the serving process and handed to every worker,
    which all accept on it. Not SO_REUSEPORT: a second server on the same port fails to
    start instead of silently taking half of the connections."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # restart past TIME_WAIT
    sock.bind((host, port))
    sock.listen(2048)
    return sock


def run_api_worker(run_dir: str, options: ServerOptions, vocab_size: int, rank: int,
                   parent_pid: int, sock: socket.socket, model_dir: str | None = None) -> None:
    """Entry of one front-end worker process (spawned by `run_pipeline serve`)."""
    try:
        from setproctitle import setproctitle

        setproctitle(f"llm-pipeline:api:{rank}")
    except ImportError:
        pass
    if options.access_log:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter(f"%(asctime)s api:{rank} %(message)s"))
        access = logging.getLogger("llm_pipeline.access")
        access.addHandler(handler)
        access.setLevel(logging.INFO)
        access.propagate = False
    client = PipelineClient.connect(run_dir)
    client.wait_for_status()  # so that /health and the first requests know how things stand
    front = FrontEnd(client, options, vocab_size, model_dir)
    config = uvicorn.Config(front.app(), loop="uvloop", http="httptools", lifespan="off",
                            log_level="warning", access_log=False,
                            timeout_graceful_shutdown=5)
    server = _Server(config, front)
    watch_parent(parent_pid, lambda: setattr(server, "should_exit", True),
                 lambda: bool(server.should_exit))
    # The socket already listens. serve reads the reply address to abort what this worker
    # had in flight, should it die.
    ready_file(run_dir, rank).write_text(json.dumps({"pid": os.getpid(),
                                                     "reply_to": client.reply_to}))
    try:
        server.run(sockets=[sock])
    finally:
        client.close()


class _Server(uvicorn.Server):  # type: ignore[misc]
    """uvicorn's server, whose shutdown first ends every running request with a final answer
    (uvicorn alone waits for them a while, then cuts the open streams)."""

    def __init__(self, config: uvicorn.Config, front: FrontEnd) -> None:
        super().__init__(config)
        self.front = front

    def handle_exit(self, sig: int, frame: Any) -> None:
        self.front.stop_soon()
        super().handle_exit(sig, frame)


def ready_file(run_dir: str, rank: int) -> Path:
    return Path(run_dir) / f"api-{rank}.ready"
