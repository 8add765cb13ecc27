"""qvl: a CPU-first inference engine and server for Qwen3-VL."""

import os

__version__ = "0.1.0"

# torch's CPU allocator puts every tensor of 2 MB or more on transparent huge pages (it reads this
# once, at its first allocation, so it is set before torch is imported): a long prompt's
# activations (tens of MB each) are faulted in 2 MB at a time instead of 4 KB, and the products
# read through fewer TLB entries. THP_MEM_ALLOC_ENABLE=0 in the environment keeps torch's default.
os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")
