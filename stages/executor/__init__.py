"""Executor stage: owns the model, the paged KV cache and sampling on the device."""
