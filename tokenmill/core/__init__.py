"""Scheduling state and policy without torch: requests, the scheduler, KV blocks, prefix cache."""
