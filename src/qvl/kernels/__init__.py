"""qvl's native kernels and the plan of which runs where.

build        tiers, the compiler driver, the library's cache key, opening it with ctypes
library      the library this process runs (chosen once from the CPU or QVL_ISA)
plan         the kernel plan: per kind of layer, the kernel, its activation codes and dtype
linear, attention, elementwise, decode_step   the ctypes calls, by op family
products     the linear layers' products (native kernel or torch's, as their plan says)
ops          the model's ops: RMSNorm, RoPE, SiLU * up, attention, the one-call decode step"""
