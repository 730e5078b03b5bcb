"""Sampling on the device, batched over sequences. Runs in the executor process."""

from __future__ import annotations

import torch


def sample(logits: torch.Tensor, temperature: torch.Tensor, all_greedy: bool) -> torch.Tensor:
    """logits [S, V] float32, temperature [S] (0 = greedy) -> token ids [S] int64.

    Random draws use the exponential race (argmax of p / Exp(1)), which samples from p
    exactly and needs no host synchronisation, unlike torch.multinomial.
    """
    greedy = logits.argmax(dim=-1)
    if all_greedy:
        return greedy
    temp = temperature.clamp_min(1e-6).unsqueeze(1)
    probs = torch.softmax(logits / temp, dim=-1)
    noise = torch.empty_like(probs).exponential_()
    drawn = (probs / noise).argmax(dim=-1)
    return torch.where(temperature == 0, greedy, drawn)
