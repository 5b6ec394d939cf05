"""The API core, shared by every front end and free of any transport: the state an API process
shares and its admission (state.py), prompts to token ids (prompts.py), each protocol's
requests mapped to `SamplingParams` (native_protocol.py, openai_protocol.py,
triton_protocol.py), the native API's per-step messages (native_messages.py), strict JSON
bodies (json_body.py) and a thread pool for heavy per-request work (offload.py). http/ and
kserve/ only carry these over their wire."""
