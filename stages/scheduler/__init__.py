"""Scheduler stage: continuous batching over a paged KV cache, running ahead of the executor."""
