"""The fusions memcompile refuses Inductor, decided over plain facts.

The seam (memcompile/_torch_private/inductor_hooks.py) hooks Inductor's fusion choices, reads the
two scheduler nodes of a candidate into the facts below and asks these rules; where they refuse,
the pair is not fused, and otherwise Inductor's own choice stands. (What Inductor then fuses is
predicted by passes/fusion.py; these rules only take fusions away.)
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

# Backward nodes that recompute a forward value (marked by the rewrite, passes/partition.py).
# Inductor fuses nodes horizontally when they read the same buffers, and runs the fused kernel at
# its earliest member: a recomputation placed just before its reader in layer 0's backward was
# fused with layer 1's (they read the same saved RoPE cos/sin and masks) and so computed at the
# top of the backward, held across layer 1's. Inductor refuses such fusions only for nodes more
# than 64 apart (Scheduler.are_long_distant_nodes); for marked nodes we refuse them beyond
# RECOMPUTE_FUSION_DISTANCE, and vertical fusions too. Llama small's smallest budget: 10.26 MiB
# with Inductor's rule alone (the distance set to 10**9), 9.26 MiB with the limit
# (benchmarks/pareto.py probe child).
RECOMPUTE_FUSION_DISTANCE = 4
# Vertical fusions (a reader into its producer) are refused beyond a wider gap: a recomputation
# and its readers within one layer are up to 10 scheduler nodes apart on Llama small (its RMSNorm
# statistics and their backward kernel: 6; the recomputed SiLU and its gradient: 5; layer 1's
# mask and its attention backward: 10), layers about 45 (layer 0's attention read layer 1's
# recomputed mask 57-70 nodes later). At 4, those three were refused too: kernels split for
# nothing. (The widths of horizontal fusion do not carry over: at 8 or 16 instead of 4 Llama
# small's smallest budget rose from 9.26 to 10.75 / 10.38 MiB.)
RECOMPUTE_VERTICAL_GAP = 16

# A horizontal fusion runs both nodes as one kernel at the earlier one's place, so the later
# node's results are allocated there. Where a result of the earlier node dies before the later
# node would run, the fusion makes the two coexist where unfused the later one could take the
# dead one's memory: in the SwiGLU backward Inductor fused the product silu(g) * u (read by the
# down projection's weight-gradient matmul, then dead) with the up projection's gradient
# dh * silu(g) (they share the read of silu(g)), so at the top of Llama small's backward the two
# coexisted where the gradient fits in the product's memory; at 9.91 MiB every plan then also
# recomputed layer 0's attention to make room (3.3-3.5 ms estimated added time, 2.5 without).
# Inductor's own guard (Scheduler.can_fusion_increase_peak_memory) weighs only inputs read once,
# against 32x the bytes the fusion saves reading. Buffers smaller than this are left to Inductor:
# they do not move a peak, and the fusion saves a launch.
LIFETIME_FUSION_MIN_BYTES = 64 * 1024

# A scheduler node's place in Inductor's node order: (min_order, max_order) of the nodes it holds.
Orders = tuple[int, int]


def horizontal_too_far_for_a_recomputation(node1: Orders, node2: Orders) -> bool:
    """Two readers of the same buffers span more nodes than a horizontal fusion with a recomputed
    node may (the span as Inductor measures its own 64-node limit)."""
    span = max(abs(node1[0] - node2[1]), abs(node2[0] - node1[1]))
    return span > RECOMPUTE_FUSION_DISTANCE


def vertical_too_far_for_a_recomputation(node1: Orders, node2: Orders) -> bool:
    """A producer and its reader lie further apart than a vertical fusion with a recomputed node
    may (Inductor has no distance limit there): a recomputed reader fused into a producer far
    before it runs there. On Llama small at 9.91 MiB layer 0's recomputed attention masks (two
    256 KiB buffers) were fused into the kernel that recomputed layer 1's boolean mask, at the top
    of the backward, and held through layer 1's backward: every plan the solver made checked
    256-512 KiB over its model. Within the gap a recomputed chain and its readers in one layer
    still fuse."""
    gap = max(node2[0] - node1[1], node1[0] - node2[1])
    return gap > RECOMPUTE_VERTICAL_GAP


@dataclass(frozen=True)
class FusedResult:
    """A result of one node of a candidate horizontal fusion, as the lifetime rule reads it."""

    stored_bytes: int  # its own storage (0: a view, a tuple, a mutation: nothing to allocate)
    # Where each reader outside the pair runs (the min_order of the fused node holding it); None:
    # the graph's output node reads it (it never dies).
    reader_orders: tuple[int | None, ...]
    graph_output: bool


def fusion_extends_a_lifetime(early: Iterable[FusedResult], late_outliving_bytes: Iterable[int], late_order: int) -> bool:
    """Whether fusing two nodes with no dependency between them keeps a large result of the
    earlier one (`early`: its results) alive while the later one's large results are allocated
    (`late_outliving_bytes`: the stored bytes of each of its results read outside the pair, at
    `late_order`), where unfused the earlier one's readers (outside the pair) all run before the
    later node. Iterables: the seam reads `early` only where the later node allocates something
    large."""
    if not any(nbytes >= LIFETIME_FUSION_MIN_BYTES for nbytes in late_outliving_bytes):
        return False  # the later node allocates nothing large that outlives the kernel
    for result in early:
        if not result.reader_orders or result.graph_output or result.stored_bytes < LIFETIME_FUSION_MIN_BYTES:
            continue
        if None in result.reader_orders:
            continue  # read by the graph's output node: never dies
        if max(order for order in result.reader_orders if order is not None) < late_order:
            return True
    return False
