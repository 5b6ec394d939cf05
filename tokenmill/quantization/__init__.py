"""Quantization: the schemes' arithmetic, the kernels `Linear` layers switch to, calibration
and quantized checkpoints (which method runs is config/quantization.py's `QuantConfig`)."""
