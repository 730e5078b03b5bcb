"""The --device option's syntax: a torch device, or the timed instrument that stands in for a
model. Read where the executor's config is built (ExecutorConfig.for_device)."""

from __future__ import annotations

from ipc.errors import ConfigError

TIMED_SYNTAX = "timed:A,B[,S]"


def parse_device(text: str) -> tuple[str, tuple[float, float, float] | None]:
    """--device: 'cpu', 'cuda[:N]', or 'timed:A,B[,S]' (the measuring instrument, which runs
    on the CPU: A + B * tokens milliseconds a step on its device, S milliseconds of the host's
    own work to launch each step, 0 if left out) -> (torch device, (A, B, S) or None)."""
    if text == "cuda":
        return "cuda:0", None  # the executor sets the current device: it needs an index
    if not text.startswith("timed:"):
        return text, None
    try:
        values = [float(x) for x in text[len("timed:"):].split(",")]
    except ValueError:
        values = []
    if len(values) == 2:
        values.append(0.0)
    if len(values) != 3 or min(values) < 0:
        raise ConfigError(f"--device {text!r}: use cpu, cuda[:N] or {TIMED_SYNTAX} with A, B, "
                          "S >= 0 milliseconds (A + B * tokens a step on the device, S of "
                          "host work to launch it)")
    a, b, s = values
    return "cpu", (a, b, s)
