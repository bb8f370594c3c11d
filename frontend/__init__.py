"""The fronts: the gRPC server that wires the cluster together, the OpenAI-compatible HTTP front (protocol,
output, tool calls, chat templates), the client and the ``magicserve`` command line. It may import every
other package; none imports it."""
