"""The OpenAI-compatible HTTP front end: its worker processes, routes, request mapping and
metrics."""
