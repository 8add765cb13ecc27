"""qvl: a CPU-first inference engine and server for Qwen3-VL."""

__version__ = "0.1.0"
