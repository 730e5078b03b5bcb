"""The pipeline: frozen configs, the launcher, clients, the CLI and the benchmarks."""
