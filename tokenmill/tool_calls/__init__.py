"""Tool calling: the request's tools and tool_choice (request.py), the parsers that read
calls out of model text (parsers.py) and their streaming form (stream.py)."""
