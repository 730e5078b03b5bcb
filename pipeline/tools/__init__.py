"""Tooling around the engine: benchmarks, their datasets and plots, random test models, and the
default model's one-off conversion."""
