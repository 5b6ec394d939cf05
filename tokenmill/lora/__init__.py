"""LoRA adapters served beside their base model: `request.py` (`LoRARequest`, which adapter a
request runs with), `adapter.py` (a PEFT adapter read and checked against the model),
`trtllm_format.py` (TensorRT-LLM's adapter tensors, kept as a folder and read back),
`layers.py` (the low-rank products added to a linear layer's, grouped by adapter),
`triton_ops.py` (those products on a GPU in two Triton kernels), `manager.py` (adapters kept
in memory and in the step's slots), `registry.py` (the adapters an engine serves by name)."""
