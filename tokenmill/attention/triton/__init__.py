"""The GPU attention backend: Triton kernels over the paged cache and the backend that runs them."""
