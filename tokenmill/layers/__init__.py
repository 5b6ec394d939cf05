"""Model building blocks: linear (replicated, parallel, quantized kernels), norm, rotary,
activation, embedding and LM head, mixtures of experts, and Triton layer ops."""
