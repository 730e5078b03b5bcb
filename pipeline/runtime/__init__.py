"""The runtime: the launcher that owns a pipeline's processes, and the client every front end
uses."""
