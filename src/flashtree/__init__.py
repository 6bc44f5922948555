"""flashtree: fast GGUF inference for qwen35 models with DFlash drafting and DDTree verification."""

__version__ = "0.1.0"
