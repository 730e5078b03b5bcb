"""Wire types, codec, ZeroMQ channels and shared-memory rings. Imports no other package of ours."""
