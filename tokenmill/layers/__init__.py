"""Model building blocks: linear (replicated, parallel, quantized kernels), norm, rotary,
activation, embedding and LM head, mixtures of experts, the sampler's ops and Triton layer ops."""
