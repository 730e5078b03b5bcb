"""The run secret that opens every frame between stages, derived from the stage key so that it
never crosses the network, and the proofs that a side holds a key without sending it. Used by
the launcher, a stage joining from another host and a remote client."""

from __future__ import annotations

import hashlib
import hmac


def derive_run_secret(stage_key: str, run_id: str) -> bytes:
    """The secret every frame between the stages of run `run_id` starts with, when stages may
    join from other hosts: each side derives it from the stage key it holds."""
    mac = hmac.new(stage_key.encode(), f"llm-pipeline run secret {run_id}".encode(),
                   hashlib.sha256)
    return mac.digest()[:16]


def proof(key: str, *parts: str) -> str:
    """HMAC-SHA256 of the parts under a key (hex): what proves a request or an answer came
    from a holder of the stage key or the client key."""
    mac = hmac.new(key.encode(), "\n".join(parts).encode(), hashlib.sha256)
    return mac.hexdigest()
