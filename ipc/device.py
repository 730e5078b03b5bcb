"""The --device option's syntax: a torch device, or the timed instrument that stands in for a
model. Read where the executor's config is built (ExecutorConfig.for_device)."""

from __future__ import annotations

from ipc.errors import ConfigError


def parse_device(text: str) -> tuple[str, tuple[float, float] | None]:
    """--device: 'cpu', 'cuda[:N]', or 'timed:A,B' (the measuring instrument, which runs on the
    CPU: A + B * tokens milliseconds a step) -> (torch device, (A, B) or None)."""
    if text == "cuda":
        return "cuda:0", None  # the executor sets the current device: it needs an index
    if not text.startswith("timed:"):
        return text, None
    try:
        a, b = (float(x) for x in text[len("timed:"):].split(","))
    except ValueError:
        a = b = -1.0
    if a < 0 or b < 0:
        raise ConfigError(f"--device {text!r}: use cpu, cuda[:N] or timed:A,B "
                          "with A, B >= 0 milliseconds (A + B * tokens per step)")
    return "cpu", (a, b)
