"""Liveness: bytes held by tensors at every step of forward-then-backward, as the graphs run.

The unit of memory is a *storage*: a view (or an in-place write) shares the storage of its base,
so aliases are counted once. A storage is allocated by the node that creates it, stays live
while any alias of it may still be read, and is freed right after its last reader, except what
the step hands on: forward outputs (held by the caller until the step ends), saved tensors
(held until their last backward reader) and gradients (accumulated into `.grad`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx as fx

from memcompile import _torch_private as tp
from memcompile.passes.graph_facts import (
    effective_reads,
    transient_bytes,
    inlined_pointwise,
    is_aliasing_op,
    is_getitem,
    tensor_nbytes,
)
from memcompile.passes.stored_forms import HOST_PREFIX

# Bytes an op may allocate and free inside itself (wrapped Python scalars, small workspaces) that
# no graph node shows and no workspace model explains (2.7 KB seen once in a float64 attention
# backward, cause not found yet); counted at every step so tiny graphs keep their budget too.
OP_SCRATCH_BYTES = 4096

# Categories a storage is counted under, for the plan's breakdown.
STATIC = "parameters_and_inputs"
SAVED = "saved_activations"
TEMPORARY = "temporaries"
GRADIENT = "gradients"
OUTPUT = "outputs"


@dataclass(frozen=True)
class LiveStep:
    phase: str  # "forward" | "backward"
    node: str
    live_bytes: int


@dataclass(frozen=True)
class LivenessTimeline:
    steps: tuple[LiveStep, ...]
    static_bytes: int
    peak_bytes: int
    peak_index: int
    peak_breakdown: tuple[tuple[str, int], ...]  # (category, bytes) live at the peak

    @property
    def peak_step(self) -> LiveStep:
        return self.steps[self.peak_index]


@dataclass
class _Storage:
    nbytes: int
    category: str
    last_step: int = -1
    pinned: bool = False  # held past the phase (outputs, saved tensors, grads, static)


def _storage_roots(gm: fx.GraphModule, prefix: str, placeholder_key, inlined: set) -> tuple[dict, dict]:
    """Map each node to the storage it reads/creates; returns (node->key, key->(nbytes, creator))."""
    roots: dict[fx.Node, str | None] = {}
    created: dict[str, tuple[int, fx.Node]] = {}
    for node in gm.graph.nodes:
        if node in inlined:
            roots[node] = None  # fused into its consumer: no buffer of its own
        elif node.op == "placeholder":
            key = placeholder_key(node)
            roots[node] = key
            if key is not None and key not in created:
                created[key] = (tensor_nbytes(node.meta.get("val")), node)
        elif node.op == "output":
            continue
        elif is_getitem(node):
            parent = node.args[0]
            if is_aliasing_op(parent) and isinstance(parent.args[0], fx.Node):
                roots[node] = roots.get(parent.args[0])
            else:
                key = f"{prefix}{parent.name}#{node.args[1]}"
                roots[node] = key
        elif is_aliasing_op(node) and node.args and isinstance(node.args[0], fx.Node):
            roots[node] = roots.get(node.args[0])
        else:
            val = node.meta.get("val")
            if isinstance(val, torch.Tensor):
                key = f"{prefix}{node.name}"
                roots[node] = key
                # Offloaded copies live in host memory, not on the device the budget is for.
                created[key] = (0 if node.name.startswith(HOST_PREFIX) else tensor_nbytes(val), node)
            elif isinstance(val, (tuple, list)):
                roots[node] = None
                for i, member in enumerate(val):
                    if isinstance(member, torch.Tensor):
                        created[f"{prefix}{node.name}#{i}"] = (tensor_nbytes(member), node)
            else:
                roots[node] = None
    return roots, created


def _inlined(gm: fx.GraphModule, fuse_pointwise: bool) -> set[fx.Node]:
    if not fuse_pointwise:
        return set()
    out = gm.graph.find_nodes(op="output")[0]
    return inlined_pointwise(list(gm.graph.nodes), set(out.all_input_nodes))


def analyze_liveness(
    fw: fx.GraphModule, bw: fx.GraphModule | None, num_fwd_outputs: int, *, fuse_pointwise: bool = False
) -> LivenessTimeline:
    """Timeline of live bytes over `fw` then `bw` (AOTAutograd's partitioned graphs).

    `fw` returns [user outputs..., saved tensors and symints...]; `bw` takes the saved values as
    placeholders named like the forward nodes that produced them, then tangents.
    `fuse_pointwise` models Inductor's fusion of single-use pointwise chains (no buffer between
    them); without it every node's result is a buffer, as when the FX interpreter runs the graph.
    """
    storages: dict[str, _Storage] = {}
    steps: list[LiveStep] = []
    live: dict[str, _Storage] = {}
    peak = {"bytes": -1, "breakdown": ()}

    def live_total() -> int:
        return sum(s.nbytes for s in live.values())

    def record(phase: str, node: fx.Node) -> None:
        scratch = OP_SCRATCH_BYTES + transient_bytes(node)
        total = live_total() + scratch
        steps.append(LiveStep(phase, node.name, total))
        if total > peak["bytes"]:
            by_category: dict[str, int] = {}
            for s in live.values():
                by_category[s.category] = by_category.get(s.category, 0) + s.nbytes
            by_category["op_scratch_and_workspace"] = scratch
            peak["bytes"] = total
            peak["breakdown"] = tuple(sorted(by_category.items()))

    # ---- forward
    fw_inlined = _inlined(fw, fuse_pointwise)
    fw_roots, fw_created = _storage_roots(fw, "", lambda n: n.name, fw_inlined)
    fw_nodes = [n for n in fw.graph.nodes if n.op not in ("placeholder", "output")]
    for key, (nbytes, creator) in fw_created.items():
        category = STATIC if creator.op == "placeholder" else TEMPORARY
        storages[key] = _Storage(nbytes, category, pinned=creator.op == "placeholder")
    _mark_last_reads(fw_nodes, fw_roots, fw_inlined, storages)
    fw_out = fw.graph.find_nodes(op="output")[0]
    fw_out_args = list(fw_out.args[0])
    handed_on: dict[str, str] = {}  # saved value name -> storage key
    for i, arg in enumerate(fw_out_args):
        if not isinstance(arg, fx.Node):
            continue
        key = fw_roots.get(arg)
        if key is None or key not in storages:
            continue
        storage = storages[key]
        storage.pinned = True
        if storage.category != STATIC:
            storage.category = OUTPUT if i < num_fwd_outputs else SAVED
        if i >= num_fwd_outputs:
            handed_on[arg.name] = key
    for key, s in storages.items():
        if s.category == STATIC:
            live[key] = s
    static_bytes = live_total()
    _run_phase("forward", fw_nodes, _keys_by_creator(fw_created), live, storages, record)

    # ---- backward
    if bw is not None:
        # Saved tensors arrive as placeholders; their storage is the forward one. Tangents are new.
        def bw_placeholder_key(node: fx.Node) -> str | None:
            if node.name in handed_on:
                return handed_on[node.name]
            if tp.is_tangent(node):
                return f"bw:{node.name}"
            return None  # symints / opaque

        bw_inlined = _inlined(bw, fuse_pointwise)
        bw_roots, bw_created = _storage_roots(bw, "bw:", bw_placeholder_key, bw_inlined)
        bw_nodes = [n for n in bw.graph.nodes if n.op not in ("placeholder", "output")]
        for key, (nbytes, creator) in bw_created.items():
            if key in storages:
                continue
            storages[key] = _Storage(nbytes, TEMPORARY)
        # Saved tensors are released by the backward after their last reader there.
        for key in handed_on.values():
            if storages[key].category == SAVED:
                storages[key].pinned = False
                storages[key].last_step = -1
        _mark_last_reads(bw_nodes, bw_roots, bw_inlined, storages)
        bw_out = bw.graph.find_nodes(op="output")[0]
        for arg in bw_out.args[0]:
            if isinstance(arg, fx.Node) and bw_roots.get(arg) is not None:
                storage = storages[bw_roots[arg]]
                if storage.category != STATIC:
                    storage.pinned = True
                    storage.category = GRADIENT
        for key, (nbytes, creator) in bw_created.items():
            if creator.op == "placeholder":
                live[key] = storages[key]
        for key in [k for k, s in live.items() if not s.pinned and s.last_step < 0]:
            del live[key]  # saved tensors backward never reads
        _run_phase("backward", bw_nodes, _keys_by_creator(bw_created), live, storages, record)

    if not steps:
        steps.append(LiveStep("forward", "<empty>", static_bytes))
        peak["breakdown"] = ((STATIC, static_bytes),)
    peak_index = max(range(len(steps)), key=lambda i: steps[i].live_bytes)
    return LivenessTimeline(
        tuple(steps), static_bytes, steps[peak_index].live_bytes, peak_index, peak["breakdown"]
    )


def _mark_last_reads(nodes: list[fx.Node], roots: dict, inlined: set, storages: dict[str, _Storage]) -> None:
    """Each storage's last reader, as a step index into `nodes` (the phase's run order)."""
    for step, node in enumerate(nodes):
        for inp in effective_reads(node, inlined):
            key = roots.get(inp)
            if key is not None and key in storages:
                storages[key].last_step = max(storages[key].last_step, step)


def _run_phase(phase: str, nodes: list[fx.Node], creates: dict[fx.Node, list[str]], live: dict[str, _Storage],
               storages: dict[str, _Storage], record) -> None:
    """Walk one graph: allocate what each node creates, record the step, free what is done."""
    for step, node in enumerate(nodes):
        for key in creates.get(node, ()):
            live[key] = storages[key]
        record(phase, node)
        for key in [k for k, s in live.items() if not s.pinned and s.last_step <= step]:
            del live[key]


def _keys_by_creator(created: dict[str, tuple[int, fx.Node]]) -> dict[fx.Node, list[str]]:
    by_creator: dict[fx.Node, list[str]] = {}
    for key, (_nbytes, creator) in created.items():
        by_creator.setdefault(creator, []).append(key)
    return by_creator
