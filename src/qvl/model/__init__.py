"""Pure-torch Qwen3-VL model: no I/O, no tokenizers, no argument parsing."""
