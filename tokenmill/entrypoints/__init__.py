"""How users reach the engine: the `tokenmill` command, the server process and its API workers,
the HTTP and KServe gRPC front ends, and the offline `LLM`."""
