"""What the CUDA caching allocator counts for one allocation: the bytes of the block it hands out.

`torch.cuda.max_memory_allocated` is the peak of the allocator's `allocated_bytes` stat, which
grows by the size of the block each allocation gets (not the bytes requested, not the segment
that was cudaMalloc'ed: that is `reserved_bytes`). Facts from PyTorch's
c10/cuda/CUDACachingAllocator.cpp (torch 2.13), modelled here:

- every request is rounded up to a multiple of kMinBlockSize = 512 B (round_size; a request
  under 512 B takes 512 B; an empty tensor allocates nothing);
- requests of at most kSmallSize = 1 MiB come from the small pool, carved out of 2 MiB
  segments (kSmallBuffer); a block there is split whenever at least 512 B would remain, so the
  allocation holds exactly its rounded size;
- larger requests come from the large pool: a new segment is 20 MiB (kLargeBuffer) for requests
  under kMinLargeAlloc = 10 MiB and the request rounded up to 2 MiB (kRoundLarge) above; a block
  there is split only when MORE than kSmallSize would remain (should_split), otherwise the whole
  block is allocated (alloc_found_block counts `block->size`). So a request of 10 MiB or more whose
  2 MiB-rounded segment leaves at most 1 MiB over holds the whole segment: GPT-2's bf16 logits at
  8 x 1024 tokens (823,410,688 B) hold 786 MiB, 0.74 MiB more than requested;
- `expandable_segments:True` (PYTORCH_ALLOC_CONF, or the older PYTORCH_CUDA_ALLOC_CONF) splits
  whenever 512 B would remain: every allocation holds exactly its rounded size;
- `max_split_size_mb:N`: blocks of N MiB or more are never split, so such a request holds its
  whole new segment;
- `roundup_power2_divisions:N` (the single-number form): requests above N x 512 B are rounded up
  to the next of N equal divisions between two powers of two (roundup_power2_next_division).

Not modelled (the prediction can be below what is measured by these):
- a large-pool request served from a cached free block larger than a new segment would be: when
  no more than 1 MiB would remain the whole block is allocated, so an allocation of 1 MiB or more
  may hold up to 1 MiB beyond what is modelled, depending on which blocks the step's earlier
  allocations freed (best fit, per stream). A step that allocates the same sizes every time gets
  its own blocks back and holds what a new segment gives;
- the per-interval form of roundup_power2_divisions ("[256:1,512:2,>:4]") and
  `backend:cudaMallocAsync` (another allocator): exact sizes are counted, with a warning;
- fragmentation and segment sizes themselves: they decide reserved memory (and out-of-memory
  errors), not the allocated bytes the budget bounds;
- views share their base's block and are counted once by the liveness pass, which also counts
  each storage once; memory allocated outside the caching allocator (cuDNN/cuBLAS handles' own
  state, the CUDA context) is not in `max_memory_allocated` at all; the cuBLAS workspaces, which
  are, are in the budget's reserve (cost_models/device.py blas_workspace_bytes).
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from typing import Mapping

log = logging.getLogger("memcompile")

MIB = 2**20
MIN_BLOCK_BYTES = 512  # kMinBlockSize
SMALL_SIZE_BYTES = MIB  # kSmallSize: the largest small-pool request
SMALL_BUFFER_BYTES = 2 * MIB  # kSmallBuffer: a small-pool segment
LARGE_BUFFER_BYTES = 20 * MIB  # kLargeBuffer: the segment for requests under MIN_LARGE_ALLOC_BYTES
MIN_LARGE_ALLOC_BYTES = 10 * MIB  # kMinLargeAlloc
ROUND_LARGE_BYTES = 2 * MIB  # kRoundLarge


@dataclass(frozen=True)
class AllocatorRounding:
    """How the step's device allocator sizes the block of one allocation. `exact` (the CPU, whose
    allocator events report the bytes requested): no rounding at all."""

    exact: bool = True
    expandable_segments: bool = False
    max_split_bytes: int | None = None  # blocks at least this large are never split
    power2_divisions: int = 0  # roundup_power2_divisions (0 or 1: off)

    def allocated_bytes(self, nbytes: int) -> int:
        """The bytes `max_memory_allocated` counts for one allocation of `nbytes`."""
        if self.exact or nbytes <= 0:
            return max(nbytes, 0)
        size = self._rounded(nbytes)
        if size <= SMALL_SIZE_BYTES or self.expandable_segments:
            return size  # small pool, or split whenever 512 B remain
        segment = new_segment_bytes(size)
        never_split = self.max_split_bytes is not None and size >= self.max_split_bytes
        if never_split or segment - size <= SMALL_SIZE_BYTES:
            return segment  # the block is not split: all of it is allocated
        return size

    def _rounded(self, nbytes: int) -> int:
        divisions = self.power2_divisions
        if nbytes < MIN_BLOCK_BYTES:
            return MIN_BLOCK_BYTES
        if divisions > 1 and nbytes > MIN_BLOCK_BYTES * divisions:
            return _round_up_power2_division(nbytes, divisions)
        return round_up(nbytes, MIN_BLOCK_BYTES)


EXACT = AllocatorRounding()
CUDA_DEFAULT = AllocatorRounding(exact=False)


def round_up(nbytes: int, multiple: int) -> int:
    return -(-nbytes // multiple) * multiple


def new_segment_bytes(rounded_bytes: int) -> int:
    """The cudaMalloc a request of `rounded_bytes` (already block-rounded) makes when no cached
    block fits (get_allocation_size)."""
    if rounded_bytes <= SMALL_SIZE_BYTES:
        return SMALL_BUFFER_BYTES
    if rounded_bytes < MIN_LARGE_ALLOC_BYTES:
        return LARGE_BUFFER_BYTES
    return round_up(rounded_bytes, ROUND_LARGE_BYTES)


def _round_up_power2_division(nbytes: int, divisions: int) -> int:
    """`nbytes` rounded up to the next of `divisions` equal steps between the powers of two around
    it (a power of two stays); with more divisions than the interval has bytes, the next power."""
    if nbytes & (nbytes - 1) == 0:
        return nbytes
    floor = 1 << (nbytes.bit_length() - 1)
    step = floor >> (divisions.bit_length() - 1)  # floor / the largest power of two <= divisions
    if step == 0:
        return floor << 1
    return round_up(nbytes, step)


def allocator_rounding_for(device: str, environ: Mapping[str, str]) -> AllocatorRounding:
    """The rounding of the allocator a step on `device` allocates from ("cuda", "cuda:1", "cpu",
    ...), under the allocator settings in `environ` (PYTORCH_ALLOC_CONF, else the older
    PYTORCH_CUDA_ALLOC_CONF). Decided once, where the step's device is known."""
    if not device.startswith("cuda"):
        return EXACT
    config = environ.get("PYTORCH_ALLOC_CONF") or environ.get("PYTORCH_CUDA_ALLOC_CONF") or ""
    settings: dict[str, str] = {}
    for item in re.split(r",(?![^\[]*\])", config):  # commas inside [...] belong to a value
        key, _, value = item.partition(":")
        if key.strip():
            settings[key.strip()] = value.strip()
    if settings.get("backend", "native") != "native":
        log.warning("memcompile: allocator backend %s: its block sizes are not modelled; counting requested "
                    "bytes", settings["backend"])
        return EXACT
    expandable = settings.get("expandable_segments", "").lower() == "true"
    max_split = settings.get("max_split_size_mb", "")
    divisions_text = settings.get("roundup_power2_divisions", "")
    divisions = 0
    if divisions_text.isdigit():
        divisions = int(divisions_text)
    elif divisions_text:
        log.warning("memcompile: roundup_power2_divisions:%s is not modelled; counting 512 B blocks",
                    divisions_text)
    return AllocatorRounding(exact=False, expandable_segments=expandable,
                             max_split_bytes=int(max_split) * MIB if max_split.isdigit() else None,
                             power2_divisions=divisions)
