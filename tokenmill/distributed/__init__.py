"""Tensor parallelism: process groups, collectives and the executors that start ranks."""
