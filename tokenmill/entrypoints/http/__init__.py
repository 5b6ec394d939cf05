"""The HTTP front ends on one FastAPI app: the native (seed) API, OpenAI, Triton's generate API,
tokenize, the dashboard, and their middleware (body limits, access log, tracing)."""
