"""Requests run in batches: `lines.py` (JSONL request lines answered as the live routes
answer them), `run_batch.py` (`tokenmill run-batch -i in.jsonl -o out.jsonl`, vLLM's
run_batch), `store.py` and `api.py` (OpenAI's Files and Batch APIs on the server)."""
