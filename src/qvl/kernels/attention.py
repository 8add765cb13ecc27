"""ctypes bindings of the attention kernels: the flash kernel (vision, causal prefill over the
paged cache), vision attention in 8-bit and 16-bit integer codes, and decode attention (one
query per row over the paged cache). Each returns None where it does not take the inputs."""

from __future__ import annotations

import ctypes

import torch

from qvl.kernels.build import DTYPES
from qvl.threads import kernel_threads


def attention(lib: ctypes.CDLL, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              causal_from: int | None = None) -> torch.Tensor | None:
    """Attention of T queries over S keys (AVX512-BF16 builds): q [T, H, D], k and v
    [S, H_kv, D] bf16 (any token/head strides, D contiguous) -> [T, H, D] contiguous.
    causal_from=None: every query sees every key (vision); an int p: query t sits at position
    p + t and sees keys 0..p+t (prefill over a cache). Head sizes: on AMX tiles where the CPU
    has them any even D up to 128, else 32, 64, 128 or 256 (vision also 72 and 80). None when
    the shapes do not apply."""
    t, h, d = q.shape
    s, hkv = k.shape[0], k.shape[1]
    if d % 2 or h % hkv or any(x.dtype != torch.bfloat16 or x.stride(2) != 1 for x in (q, k, v)):
        return None
    out = torch.empty(t, h, d, dtype=torch.bfloat16)
    status = lib.qvl_attention(q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), t, s, h, hkv, d,
                               q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
                               out.stride(0), out.stride(1), -1 if causal_from is None else causal_from, None, 0, 0,
                               kernel_threads())
    if status == -1:
        raise MemoryError("qvl_attention could not allocate its packed keys and values")
    return out if status == 0 else None


def attention_q8(lib: ctypes.CDLL, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor | None:
    """Full attention (the vision tower: no mask) in 8-bit integer codes (AVX-512 builds with VNNI
    and BF16): scores from keys centred over the image with a step per 64 keys and queries with a
    step per row, P and V with a step per 64 keys (per row and per channel), every product on
    vpdpbusd. q [T, H, D], k and v [S, H, D] bf16 (any token/head strides, D contiguous; D 64, 72
    or 80) -> [T, H, D] contiguous. None when the shapes do not apply or an input holds a NaN or
    an infinity."""
    t, h, d = q.shape
    s = k.shape[0]
    if k.shape[1] != h or v.shape[1] != h or any(x.dtype != torch.bfloat16 or x.stride(2) != 1 for x in (q, k, v)):
        return None
    out = torch.empty(t, h, d, dtype=torch.bfloat16)
    status = lib.qvl_attention_q8(q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), t, s, h, d,
                                  q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
                                  out.stride(0), out.stride(1), kernel_threads())
    if status == -1:
        raise MemoryError("qvl_attention_q8 could not allocate its packed keys and values")
    return out if status == 0 else None


def attention_i16(lib: ctypes.CDLL, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor | None = None,
                  sin: torch.Tensor | None = None) -> torch.Tensor | None:
    """Full attention (the vision tower: no mask) with the products in 16-bit integer codes
    (AVX2 and AVX-512 builds): q [T, H, D], k and v [S, H, D] float32 (any token/head strides,
    D contiguous; D 64, 72 or 80) -> [T, H, D] contiguous. cos, sin (the tower's RoPE tables,
    [S, 1, D] or [S, D] float32): q and k are not rotated yet and the kernel rotates them as it
    codes them (T == S). None when the shapes do not apply or an input holds a NaN or an
    infinity (the float path carries those as the reference does)."""
    t, h, d = q.shape
    s = k.shape[0]
    if k.shape[1] != h or v.shape[1] != h or any(x.dtype != torch.float32 or x.stride(2) != 1 for x in (q, k, v)):
        return None
    tables = None
    if cos is not None:
        tables = [x.reshape(x.shape[0], -1) for x in (cos, sin)]
        if t != s or any(x.shape != (s, d) or x.dtype != torch.float32 or x.stride(1) != 1 for x in tables) \
                or tables[0].stride(0) != tables[1].stride(0):
            return None
    out = torch.empty(t, h, d)
    status = lib.qvl_attention_i16(q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), t, s, h, d,
                                   q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
                                   out.stride(0), out.stride(1), *((x.data_ptr() for x in tables) if tables else
                                                                   (None, None)),
                                   tables[0].stride(0) if tables else 0, kernel_threads())
    if status == -1:
        raise MemoryError("qvl_attention_i16 could not allocate its packed keys and values")
    return out if status == 0 else None


def check_table(table: torch.Tensor, lengths: torch.Tensor, block: int, blocks: int, what: str) -> None:
    """Raise IndexError unless the blocks holding each row's first lengths[b] positions
    (table [B, max_blocks], -1 past a row's blocks) are all in a pool of `blocks` blocks: the
    kernels read and write through the table unchecked."""
    held = torch.arange(table.shape[1])[None] < ((lengths + block - 1) // block)[:, None]
    if int(lengths.max()) > table.shape[1] * block or bool(((table < 0) & held).any()) or int(table.max()) >= blocks:
        raise IndexError(f"{what}: a position outside its row's blocks")


def paged_attention(lib: ctypes.CDLL, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                    blocks: torch.Tensor, causal_from: int) -> torch.Tensor | None:
    """Causal prefill attention of one row over the paged cache (AVX512-BF16 builds; on AMX
    tiles where the CPU has them): q
    [T, H, D] bf16 (any token/head strides, D contiguous) at positions causal_from.. over
    that row's keys and values, one layer of the pool [blocks, H_kv, BLOCK, D], position j in
    block blocks[j // BLOCK] ([>= ceil((causal_from + T) / BLOCK)] int64) -> [T, H, D]
    contiguous. Head sizes as attention's. None when the shapes do not apply."""
    t, h, d = q.shape
    n, hkv, block = keys.shape[0], keys.shape[1], keys.shape[2]
    if d % 2 or h % hkv or any(x.dtype != torch.bfloat16 or x.stride(-1) != 1 for x in (q, keys, values)):
        return None
    if keys.stride() != values.stride() or keys.stride(2) != d or not keys.is_contiguous():
        return None
    s = causal_from + t
    used = blocks[: -(-s // block)].to(torch.int64).contiguous()
    check_table(used[None], torch.tensor([s]), block, n, "paged attention")
    out = torch.empty(t, h, d, dtype=torch.bfloat16)
    status = lib.qvl_attention(q.data_ptr(), keys.data_ptr(), values.data_ptr(), out.data_ptr(), t, s, h, hkv, d,
                               q.stride(0), q.stride(1), d, keys.stride(1), d, values.stride(1), out.stride(0),
                               out.stride(1), causal_from, used.data_ptr(), block, keys.stride(0),
                               kernel_threads())
    if status == -1:
        raise MemoryError("qvl_attention could not allocate its packed keys and values")
    return out if status == 0 else None


def decode_attention(lib: ctypes.CDLL, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                     table: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor | None:
    """One query per row over the paged cache: q [B, H, 1, D]; keys/values one layer of the
    pool [blocks, Hkv, BLOCK, D], all bf16 or all float32; batch row b reads its first
    lengths[b] positions ([B] int64, >= 1), position j in block table[b, j // BLOCK] (table
    [B, max_blocks] int64) -> [B, H, 1, D]. None when the shapes do not apply (then use SDPA)."""
    b, h, _, d = q.shape
    n, hkv, block = keys.shape[0], keys.shape[1], keys.shape[2]
    if q.dtype not in DTYPES or keys.dtype != q.dtype or values.dtype != q.dtype:
        return None
    if keys.stride() != values.stride() or not keys.is_contiguous():
        return None
    q = q.contiguous()
    table, lengths = table.to(torch.int64).contiguous(), lengths.to(torch.int64).contiguous()
    check_table(table, lengths, block, n, "decode attention")
    out = torch.empty(b, h, 1, d, dtype=q.dtype)
    status = lib.qvl_decode_attention(q.data_ptr(), keys.data_ptr(), values.data_ptr(), DTYPES[q.dtype],
                                      table.data_ptr(), table.shape[1], block, keys.stride(0), keys.stride(1), b, h,
                                      hkv, lengths.data_ptr(), d, out.data_ptr(), kernel_threads())
    if status == -1:
        raise MemoryError("qvl_decode_attention could not allocate its scores")
    return out if status == 0 else None

