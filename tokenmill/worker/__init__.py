"""Execution of one step on one rank: the model runner (inputs, forward, sampling), CUDA graphs
and their capture, KV allocation, and the draft heads' runner."""
