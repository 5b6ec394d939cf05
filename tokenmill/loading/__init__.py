"""Checkpoints into models: checkpoint.py chooses the format (HF folder, GGUF file, pre-sharded
rank files, quantized checkpoints) and loads it; gguf.py and gguf_archs.py read llama.cpp's
files; sharded.py reads pre-sharded ones. Downloads are hub/'s, conversions convert/'s."""
