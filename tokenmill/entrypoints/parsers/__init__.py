"""Reading a chat model's output and shaping its tool requests: reasoning.py
(`--reasoning-parser`: the `<think>` section), tool_calls.py (`--tool-call-parser`: calls read
out of the text), tool_stream.py (the same while streaming), tool_request.py (a request's
`tools` / `tool_choice`)."""
