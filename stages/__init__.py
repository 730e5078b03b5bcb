"""The four stage processes. Each is a pure core (unit-tested directly) plus a thin entry."""
