"""vLLM's module path, so its command lines run unchanged (see `api_server`)."""
