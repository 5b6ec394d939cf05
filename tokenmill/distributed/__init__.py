"""Parallel execution inside a model: process groups, collectives (gloo, NCCL, a shared-memory
all-reduce) and pipeline links between stages. Starting the ranks is executor/'s."""
