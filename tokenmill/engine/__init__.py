"""The engine: the core loop (scheduler + runner), its process and clients, the async and offline
engines, output processing and the data-parallel clients."""
