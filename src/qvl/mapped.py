"""Giving back the pages of memory-mapped checkpoint tensors that are no longer read.

safetensors maps a whole file once for all its tensors, so dropping one tensor frees nothing:
the pages it was read through stay resident (and counted in the process's RSS) while any
other tensor of the file lives. `release` tells the kernel those pages are not needed
(madvise MADV_DONTNEED: a clean file page is simply re-read if touched again)."""

from __future__ import annotations

import ctypes
import mmap
import os
import sys

import torch

PAGE = mmap.PAGESIZE


def release(tensor: torch.Tensor) -> bool:
    """Drop the resident pages wholly inside `tensor` when it lies in a read-only-used file
    mapping (Linux); anonymous memory is left alone (its pages are freed with the tensor).
    Returns whether pages were released."""
    if not sys.platform.startswith("linux") or tensor.numel() == 0:
        return False
    start, end = tensor.data_ptr(), tensor.data_ptr() + tensor.numel() * tensor.element_size()
    first, last = -(-start // PAGE) * PAGE, end // PAGE * PAGE
    if last <= first or not _in_file_mapping(start, end):
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return libc.madvise(first, last - first, mmap.MADV_DONTNEED) == 0


def _in_file_mapping(start: int, end: int) -> bool:
    """[start, end) lies inside one mapping of a file (not anonymous memory), per /proc/self/maps."""
    try:
        with open(f"/proc/{os.getpid()}/maps") as maps:
            for line in maps:
                fields = line.split()
                lo, hi = (int(v, 16) for v in fields[0].split("-"))
                if lo <= start < hi:
                    return end <= hi and len(fields) >= 6 and fields[4] != "0" and fields[5].startswith("/")
    except OSError:
        pass
    return False
