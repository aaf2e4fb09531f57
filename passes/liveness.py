"""Liveness: bytes held by tensors at every step of forward-then-backward, as the graphs run.

The unit of memory is a *storage*: a view (or an in-place write) shares the storage of its base,
so aliases are counted once. A storage is allocated by the node that creates it, stays live
while any alias of it may still be read, and is freed right after its last reader, except what
the step hands on: forward outputs (held by the caller until the step ends), saved tensors
(held until their last backward reader) and gradients (accumulated into `.grad`). It holds the
bytes of its allocator's block (`rounding`: on CUDA the caching allocator's 512 B blocks,
cost_models/cuda_allocator.py; on the CPU exactly its bytes); buffers are matched for reuse and
in-place writes by their exact sizes, as Inductor matches them.
"""

from __future__ import annotations

import heapq
import dataclasses
from dataclasses import dataclass

import torch
import torch.fx as fx

from memcompile import _torch_private as tp
from memcompile.cost_models.cuda_allocator import EXACT, AllocatorRounding
from memcompile.cost_models.transient_memory import (
    counted_exactly,
    kernel_workspace_bytes,
    promotion_copy_bytes,
    transient_bytes,
)
from memcompile.node_facts import is_aliasing_op, is_getitem, is_pointwise, tensor_nbytes
from memcompile.passes.fusion import FusionPrediction, FusionRules, predict_fusion
from memcompile.passes.inductor_schedule import InductorSchedule, ScheduledKernel
from memcompile.passes.graph_facts import (
    effective_reads,
    fusion_facts,
    graph_device_type,
    wrapper_allocates,
    writes_over_a_copy_of_its_first_input,
)
from memcompile.passes.stored_forms import HOST_PREFIX

# Bytes an op may allocate and free inside itself (wrapped Python scalars, small workspaces) that
# no graph node shows and no workspace model explains (2.7 KB seen once in a float64 attention
# backward, cause not found yet); counted at every step so tiny graphs keep their budget too:
# every op in graph order, every library call over Inductor's schedule (its generated kernels
# allocate nothing themselves) except matrix multiplies that read their operands in place.
OP_SCRATCH_BYTES = 4096


def op_scratch_bytes(node: fx.Node) -> int:
    """The per-op margin (OP_SCRATCH_BYTES) an op run eagerly is given, none where its memory is
    known exactly: views and tuple members (no allocation), matrix multiplies and attention that
    kernel_workspace_bytes counts exactly, pointwise ops whose inputs share their output's dtype
    (no promotion copy) and which take no Python number (wrapped into a tensor), such reductions
    on the CPU. At a budget equal to PyTorch's partition's measured peak, a margin
    counted at such an op refused the plan (PyTorch's own activation-budget cases: by 4 KiB)."""
    if node.op != "call_function" or is_aliasing_op(node) or is_getitem(node) or counted_exactly(node):
        return 0
    out = node.meta.get("val")
    inputs = [a.meta.get("val") for a in node.all_input_nodes]
    same_dtype = isinstance(out, torch.Tensor) and all(t.dtype == out.dtype for t in inputs if isinstance(t, torch.Tensor))
    if any(isinstance(a, (int, float, complex)) and not isinstance(a, bool) for a in node.args):
        return OP_SCRATCH_BYTES  # a Python number is wrapped into a tensor of its own by the op
    if same_dtype and is_pointwise(node):
        return 0
    # CPU reductions accumulate in per-thread buffers of their own (not the tensor allocator's);
    # CUDA's may take a staging buffer from the caching allocator: the margin stays there.
    if same_dtype and out.device.type == "cpu" and torch.Tag.reduction in getattr(node.target, "tags", ()):
        return 0
    return OP_SCRATCH_BYTES


# Categories a storage is counted under, for the plan's breakdown.
STATIC = "parameters_and_inputs"
SAVED = "saved_activations"
TEMPORARY = "temporaries"
GRADIENT = "gradients"
OUTPUT = "outputs"
SCRATCH = "op_scratch_and_workspace"  # what the op allocates inside itself (not a storage)
# Every category, in the order a picture stacks them (what the step starts with at the bottom).
CATEGORIES = (STATIC, GRADIENT, SAVED, OUTPUT, TEMPORARY, SCRATCH)
# The largest storages live at the peak that the timeline lists (LivenessTimeline.peak_tensors).
PEAK_TENSORS = 12


@dataclass(frozen=True)
class LiveStep:
    phase: str  # "forward" | "backward"
    node: str
    live_bytes: int
    by_category: tuple[int, ...] = ()  # live_bytes split by CATEGORIES (in that order)


@dataclass(frozen=True)
class LivenessTimeline:
    steps: tuple[LiveStep, ...]
    static_bytes: int
    peak_bytes: int
    peak_index: int
    peak_breakdown: tuple[tuple[str, int], ...]  # (category, bytes) live at the peak
    # (name, category, bytes) of the largest storages live at the peak, largest first
    peak_tensors: tuple[tuple[str, str, int], ...] = ()

    @property
    def peak_step(self) -> LiveStep:
        return self.steps[self.peak_index]

    def category_series(self) -> tuple[tuple[str, tuple[int, ...]], ...]:
        """Per category (CATEGORIES order), its live bytes at every step; () if not recorded."""
        if not self.steps or any(len(s.by_category) != len(CATEGORIES) for s in self.steps):
            return ()
        return tuple((c, tuple(s.by_category[i] for s in self.steps)) for i, c in enumerate(CATEGORIES))

    def held_by_every_plan(self) -> int:
        """The most bytes live at one step in parameters and inputs, gradients and the outputs the
        caller holds (0: not recorded by category): every plan of the same joint graph holds them
        all as its backward ends, whatever it saves or recomputes and however its kernels are
        ordered. (What else a step holds depends on the order: taken as a floor, what PyTorch's
        1.0 partition held besides saved activations refused a budget its 0.6 partition fits.)"""
        fixed = [CATEGORIES.index(c) for c in (STATIC, GRADIENT, OUTPUT)]
        return max((sum(s.by_category[i] for i in fixed) for s in self.steps
                    if len(s.by_category) == len(CATEGORIES)), default=0)

    def held_as_forward_ends(self) -> int:
        """The parameters and inputs, saved tensors and outputs live at the forward's last step (0:
        not recorded by category, or no forward): every schedule of these graphs holds them all as
        its forward's last kernel runs, so no schedule of them peaks lower."""
        start = self.backward_start()
        last = (start if start >= 0 else len(self.steps)) - 1
        if last < 0 or self.steps[last].phase != "forward" or len(self.steps[last].by_category) != len(CATEGORIES):
            return 0
        held = [CATEGORIES.index(c) for c in (STATIC, SAVED, OUTPUT)]
        return sum(self.steps[last].by_category[i] for i in held)

    def backward_start(self) -> int:
        """The index of the first backward step (-1: none)."""
        return next((i for i, s in enumerate(self.steps) if s.phase == "backward"), -1)


@dataclass
class _Storage:
    nbytes: int  # the tensor's bytes (what Inductor's reuse and in-place rules compare)
    category: str
    last_step: int = -1
    pinned: bool = False  # held past the phase (outputs, saved tensors, grads, static)
    user_visible: bool = False  # a forward output the caller holds (never written in place)
    from_input: bool = False  # a graph input (tangent): not Inductor's to overwrite
    dtype: object = None  # with nbytes, what Inductor matches a freed buffer for reuse by
    aligned: bool = True  # also in that match (see ScheduledBuffer.aligned)
    label: str = ""  # what to call it in the plan when its key is not readable (Inductor's buffers)
    held: int = -1  # the bytes its allocation holds on the device (-1: nbytes)

    def __post_init__(self) -> None:
        if self.held < 0:
            self.held = self.nbytes


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


@dataclass(frozen=True)
class _Fusion:
    """Nodes Inductor does not store (`inlined`) or may not store (`either`: counted as a buffer
    and, like an inlined one, its inputs held until its consumers read them)."""

    inlined: frozenset
    either: frozenset
    enabled: bool = False
    allocates: frozenset = frozenset()  # results the wrapper allocates (see _pool_reuses)


def _fusion(gm: fx.GraphModule, fuse_pointwise: bool) -> _Fusion:
    if not fuse_pointwise:
        return _Fusion(frozenset(), frozenset())
    facts = fusion_facts(gm)
    prediction: FusionPrediction = predict_fusion(facts, FusionRules.for_device(graph_device_type(gm)))
    nodes = {n.name: n for n in gm.graph.nodes}
    allocates = frozenset(nodes[f.name] for f in facts if f.name not in prediction.inlined and wrapper_allocates(
        f.kind, nodes[f.name]))
    return _Fusion(frozenset(nodes[n] for n in prediction.inlined), frozenset(nodes[n] for n in prediction.either),
                   enabled=True, allocates=allocates)


def analyze_liveness(
    fw: fx.GraphModule, bw: fx.GraphModule | None, num_fwd_outputs: int, *, fuse_pointwise: bool = False,
    saved_names: tuple[str | None, ...] | None = None, rounding: AllocatorRounding = EXACT,
    scatters_in_place: bool = False,
) -> LivenessTimeline:
    """Timeline of live bytes over `fw` then `bw` (AOTAutograd's partitioned graphs).

    `fw` returns [user outputs..., saved tensors and symints...]; `bw` takes the saved values as
    placeholders named like the forward nodes that produced them, then tangents.
    `fuse_pointwise` models Inductor's code generation (passes/fusion.py): bodies it inlines into
    their consumers hold no buffer, and their inputs stay live until those consumers run; without
    it every node's result is a buffer, as when the FX interpreter runs the graph.
    `saved_names`: the names the backward's placeholders know the forward's outputs by, when `fw`
    renamed them (Inductor's post-grad passes turn `add_1 = mm + x` into `addmm_default_1`).
    `rounding`: the bytes each allocation holds on the step's device (cost_models/cuda_allocator.py).
    `scatters_in_place`: a scatter or index_put writes over its first input where that dies at it,
    as Inductor's copy of it does (graph_facts.writes_over_a_copy_of_its_first_input).
    """
    storages: dict[str, _Storage] = {}
    steps: list[LiveStep] = []
    live: dict[str, _Storage] = {}
    peak = {"bytes": -1, "breakdown": ()}

    def live_total() -> int:
        return sum(s.held for s in live.values())

    def record(phase: str, node: fx.Node, fused: _Fusion) -> None:
        # An inlined body runs inside its consumer's kernel: no kernel, no transients of its own.
        # With fusion modelled the graph is Inductor's (its layout of convolutions, too).
        transient = 0 if node in fused.inlined else transient_bytes(node, fused.enabled)
        scratch = op_scratch_bytes(node) + rounding.allocated_bytes(transient)
        _record_step(steps, peak, live, phase, node.name, scratch)

    # ---- forward
    fw_fused = _fusion(fw, fuse_pointwise)
    fw_roots, fw_created = _storage_roots(fw, "", lambda n: n.name, fw_fused.inlined)
    fw_nodes = [n for n in fw.graph.nodes if n.op not in ("placeholder", "output")]
    for key, (nbytes, creator) in fw_created.items():
        category = STATIC if creator.op == "placeholder" else TEMPORARY
        storages[key] = _Storage(nbytes, category, pinned=creator.op == "placeholder", dtype=_dtype_of(key, creator),
                                 held=rounding.allocated_bytes(nbytes))
    _mark_last_reads(fw_nodes, fw_roots, fw_fused, storages)
    fw_out = fw.graph.find_nodes(op="output")[0]
    fw_out_args = list(fw_out.args[0])
    handed_on = _hand_on_outputs([(i, arg, fw_roots.get(arg)) for i, arg in enumerate(fw_out_args)
                                  if isinstance(arg, fx.Node)], storages, live, num_fwd_outputs, saved_names)
    static_bytes = live_total()
    _run_phase("forward", fw_nodes, _keys_by_creator(fw_created), live, storages,
               lambda phase, node: record(phase, node, fw_fused),
               _in_place_donors(fw_nodes, fw_roots, fw_fused, scatters_in_place), fw_fused.allocates)

    # ---- backward
    if bw is not None:
        # Saved tensors arrive as placeholders; their storage is the forward one. Tangents are new.
        def bw_placeholder_key(node: fx.Node) -> str | None:
            if node.name in handed_on:
                return handed_on[node.name]
            if tp.is_tangent(node):
                return f"bw:{node.name}"
            return None  # symints / opaque

        bw_fused = _fusion(bw, fuse_pointwise)
        bw_roots, bw_created = _storage_roots(bw, "bw:", bw_placeholder_key, bw_fused.inlined)
        bw_nodes = [n for n in bw.graph.nodes if n.op not in ("placeholder", "output")]
        for key, (nbytes, creator) in bw_created.items():
            if key in storages:
                continue
            # A tangent (the gradient of a forward output) stays allocated until the backward
            # returns: AOTAutograd's backward receives it as an argument, so the graph's last
            # read, or the wrapper's `del tangents_1`, drops one reference of several. GPT-2's
            # 4-byte loss gradient counted freed after its first kernel put the check 4 B under.
            tangent = creator.op == "placeholder"
            storages[key] = _Storage(nbytes, TEMPORARY, from_input=tangent, pinned=tangent,
                                     dtype=_dtype_of(key, creator), held=rounding.allocated_bytes(nbytes))
        # Saved tensors are released by the backward after their last reader there; one that is
        # also a user output (logits returned and saved for the loss) is the caller's until the
        # step ends.
        for key in handed_on.values():
            if storages[key].category == SAVED and not storages[key].user_visible:
                storages[key].pinned = False
                storages[key].last_step = -1
        _mark_last_reads(bw_nodes, bw_roots, bw_fused, storages)
        bw_out = bw.graph.find_nodes(op="output")[0]
        for arg in bw_out.args[0]:
            if isinstance(arg, fx.Node) and bw_roots.get(arg) is not None:
                storage = storages[bw_roots[arg]]
                if storage.category != STATIC:
                    storage.pinned = True
                    storage.category = GRADIENT
        for key, (_, creator) in bw_created.items():
            if creator.op == "placeholder":
                live[key] = storages[key]
        for key in [k for k, s in live.items() if not s.pinned and s.last_step < 0]:
            del live[key]  # saved tensors backward never reads
        _run_phase("backward", bw_nodes, _keys_by_creator(bw_created), live, storages,
                   lambda phase, node: record(phase, node, bw_fused),
                   _in_place_donors(bw_nodes, bw_roots, bw_fused, scatters_in_place), bw_fused.allocates)

    if not steps:
        steps.append(LiveStep("forward", "<empty>", static_bytes))
        peak["breakdown"] = ((STATIC, static_bytes),)
    peak_index = max(range(len(steps)), key=lambda i: steps[i].live_bytes)
    return LivenessTimeline(
        tuple(steps), static_bytes, steps[peak_index].live_bytes, peak_index, peak["breakdown"],
        peak.get("tensors", ()),
    )


def _mark_last_reads(nodes: list[fx.Node], roots: dict, fused: _Fusion, storages: dict[str, _Storage]) -> None:
    """Each storage's last reader, as a step index into `nodes` (the phase's run order)."""
    for step, node in enumerate(nodes):
        for inp in effective_reads(node, fused.inlined, fused.either):
            key = roots.get(inp)
            if key is not None and key in storages:
                storages[key].last_step = max(storages[key].last_step, step)


def _in_place_donors(nodes: list[fx.Node], roots: dict, fused: _Fusion,
                     scatters: bool = False) -> dict[fx.Node, list[str]]:
    """Storages a generated kernel may write its result into (Inductor's `inplace_buffers`,
    scheduler.decide_inplace_update): for a stored pointwise result, the storages it reads at the
    very element it writes (same shape, strides and dtype) that die at it. Only with fusion on,
    only for pointwise kernels: extern kernels (mm's out=) never write over their inputs. With
    `scatters`, in either mode, a scatter's or index_put's first input (the copy it writes into)."""
    donors: dict[fx.Node, list[str]] = {}
    if scatters:
        for node in nodes:
            first = node.args[0] if writes_over_a_copy_of_its_first_input(node) and node.args else None
            key = roots.get(first) if isinstance(first, fx.Node) else None
            out, into = node.meta.get("val"), first.meta.get("val") if key is not None else None
            if (isinstance(out, torch.Tensor) and isinstance(into, torch.Tensor) and out.is_contiguous()
                    and into.dtype == out.dtype and into.shape == out.shape and into.stride() == out.stride()
                    and into.storage_offset() == 0):
                donors[node] = [key]
    if not fused.enabled:
        return donors
    for node in nodes:
        if not is_pointwise(node) or node in fused.inlined or node in fused.either:
            continue
        out = node.meta.get("val")
        if not isinstance(out, torch.Tensor) or not out.is_contiguous():
            continue
        reads = effective_reads(node, fused.inlined, fused.either)
        by_key: dict[str, list[fx.Node]] = {}
        for inp in reads:
            key = roots.get(inp)
            if key is not None:
                by_key.setdefault(key, []).append(inp)
        keys = []
        for key, readers in by_key.items():
            vals = [r.meta.get("val") for r in readers]
            # Every access of the donor in this kernel must be the element being written.
            if all(isinstance(v, torch.Tensor) and v.dtype == out.dtype and v.shape == out.shape
                   and v.stride() == out.stride() and v.storage_offset() == 0 for v in vals):
                keys.append(key)
        if keys:
            donors[node] = keys
    return donors


def _run_phase(phase: str, nodes: list[fx.Node], creates: dict[fx.Node, list[str]], live: dict[str, _Storage],
               storages: dict[str, _Storage], record, donors: dict[fx.Node, list[str]] | None = None,
               allocates: frozenset = frozenset(), estimate: tuple[tuple[int, ...], int] | None = None,
               frees_after: tuple[bool, ...] | None = None, adjacent_reuse: bool = False) -> None:
    """Walk one graph: allocate what each node creates (in place of a dying storage it may
    overwrite, see _in_place_donors; in a freed storage kept for reuse, see _pool_reuses),
    record the step, free what is done. `frees_after[step]`: whether the wrapper frees after
    that step (False inside one C++ call of several kernels, see ScheduledKernel.call_group:
    what its members read last is freed after the call's last member); None: after every step."""
    donors = donors or {}
    reuses = _pool_reuses(nodes, creates, dict(live), storages, donors, allocates, estimate,
                          frees_after, adjacent_reuse) if allocates else {}
    held_until = {old: step for old, (step, _new) in reuses.items()}
    taken_by = {new: old for old, (_step, new) in reuses.items()}
    for step, node in enumerate(nodes):
        created = creates.get(node, ())
        _take_in_place(node, step, created, live, storages, donors)
        for key in created:
            if key in taken_by:
                live.pop(taken_by[key], None)  # the freed storage becomes this one
            live[key] = storages[key]
        record(phase, node)
        if frees_after is not None and not frees_after[step]:
            continue
        for key in [k for k, s in live.items() if not s.pinned and s.last_step <= step
                    and held_until.get(k, -1) <= step]:
            del live[key]


def _take_in_place(node, step: int, created, live: dict[str, _Storage], storages: dict[str, _Storage],
                   donors: dict) -> dict[str, str]:
    """Drop from `live` the dying storages `node`'s results are written into: {result key: donor
    key}. `donors[node]` lists the donors of a node's single result (graph order), or maps each
    result to its donors (a fused kernel of Inductor's schedule: each result may take one)."""
    if node not in donors or not created:
        return {}
    per_result = donors[node] if isinstance(donors[node], dict) else (
        {created[0]: donors[node]} if len(created) == 1 else {})
    taken: dict[str, str] = {}
    for new_key in created:
        new = storages[new_key]
        for key in per_result.get(new_key, ()):
            old = live.get(key)
            # A donor dies here, is ours to overwrite (not a parameter, input, user output or
            # gradient; saved tensors are donated to the backward) and has exactly the size of
            # the result: the result takes it over.
            if (old is not None and old.last_step == step and not old.pinned and not old.user_visible
                    and not old.from_input and old.category in (TEMPORARY, SAVED) and old.nbytes == new.nbytes
                    and old.dtype == new.dtype):
                del live[key]
                taken[new_key] = key
                new.aligned = new.aligned and old.aligned  # as Inductor's make_inplace marks it
                break
    return taken


def _pool_reuses(nodes: list[fx.Node], creates: dict[fx.Node, list[str]], live: dict[str, _Storage],
                 storages: dict[str, _Storage], donors: dict[fx.Node, list[str]],
                 allocates: frozenset,
                 estimate: tuple[tuple[int, ...], int] | None = None,
                 frees_after: tuple[bool, ...] | None = None,
                 adjacent_reuse: bool = False) -> dict[str, tuple[int, str]]:
    """Inductor's wrapper does not free a dead buffer that a later allocation of the same dtype
    and size reuses (codegen/wrapper.py: FreeIfNotReusedLine, a LIFO pool per reuse key): its
    memory stays allocated until that allocation. Returns {freed storage: (step, storage that
    reuses it)}, from a dry run of the phase. Pooled: buffers the graph allocated; not its inputs
    (saved tensors and tangents in the backward): the wrapper frees a graph input outright
    (codegen_free: `FreeLine` for an `InputBuffer`, donated or not; donation only lets a result
    be written over it in place, see _take_in_place). Counting saved tensors as pooled handed
    their memory to reuses the wrapper gives a buffer of its own, which it then holds across
    the attention backward (AttentionStack: 48 KiB under the measured peak). Reusers: results
    the wrapper allocates (`allocates`: generated kernels and mm/addmm/bmm writing into
    `out=`), not library kernels that allocate their own.

    With `adjacent_reuse` (memcompile's rule in the graphs it plans, _torch_private.InductorRules),
    only an allocation by the next kernel reuses a dead buffer. Stock Inductor reuses
    when the two are adjacent or when holding the buffer keeps its own
    estimate of the graph's peak (`should_reuse_buffer`); on Llama it held six dead 688 KiB
    buffers across our predicted peak. `estimate` is that estimate (per step, overall: Inductor's
    schedule, see _inductor_would_reuse); without it every pop is taken, which held more memory
    than Inductor's choice in every run we measured."""
    pool: dict[tuple, list[tuple[str, int]]] = {}  # reuse key -> [(freed storage, step it died)]
    # per kernel, plus one entry past the last (torch/_inductor/memory.py peak_memory_from_buf_info_list)
    held = list(estimate[0]) if estimate and len(estimate[0]) >= len(nodes) else None
    reuses: dict[str, tuple[int, str]] = {}
    for step, node in enumerate(nodes):
        created = creates.get(node, ())
        taken = _take_in_place(node, step, created, live, storages, donors)
        for key in created:
            new = storages[key]
            bucket = pool.get((new.dtype, new.nbytes, new.aligned))
            if node in allocates and key not in taken and bucket:
                old, freed_at = bucket.pop()
                if adjacent_reuse and estimate is not None:
                    # memcompile's rule in its graphs (_torch_private/inductor_hooks.py), over
                    # Inductor's kernels; the graph-order count keeps taking every reuse (a bound)
                    reused = freed_at + 1 == step
                else:
                    reused = held is None or _inductor_would_reuse(held, estimate[1], freed_at, step, new.nbytes)
                if reused:
                    reuses[old] = (step, key)
                else:
                    bucket.append((old, freed_at))  # Inductor puts it back and allocates anew
            live[key] = new
        if frees_after is not None and not frees_after[step]:
            continue  # freed (and offered for reuse) after the call's last kernel
        for key in [k for k, s in live.items() if not s.pinned and s.last_step <= step]:
            old = live.pop(key)
            if not old.user_visible and not old.from_input and old.category == TEMPORARY and old.nbytes:
                pool.setdefault((old.dtype, old.nbytes, old.aligned), []).append((key, step))
    return reuses


def _inductor_would_reuse(held: list[int], overall: int, freed_at: int, step: int, nbytes: int) -> bool:
    """Inductor's wrapper rule (codegen/wrapper.py AllocateLine.should_reuse_buffer): a buffer
    freed after kernel `freed_at` is reused by an allocation at kernel `step` when the two are
    adjacent, or when holding it in between keeps Inductor's estimate (`held`, per kernel) within
    its overall peak; a reuse raises the estimate in between by the buffer's size."""
    if freed_at + 1 == step:
        return True
    if nbytes + max(held[freed_at + 1:step], default=0) > overall:
        return False
    for i in range(freed_at + 1, step):
        held[i] += nbytes
    return True


def _dtype_of(key: str, creator: fx.Node) -> object:
    val = creator.meta.get("val")
    if "#" in key and isinstance(val, (tuple, list)):
        val = val[int(key.rsplit("#", 1)[1])]
    return getattr(val, "dtype", None)


def _keys_by_creator(created: dict[str, tuple[int, fx.Node]]) -> dict[fx.Node, list[str]]:
    by_creator: dict[fx.Node, list[str]] = {}
    for key, (_nbytes, creator) in created.items():
        by_creator.setdefault(creator, []).append(key)
    return by_creator


def analyze_scheduled_liveness(fw: fx.GraphModule, bw: fx.GraphModule | None, num_fwd_outputs: int,
                               fw_schedule: InductorSchedule, bw_schedule: InductorSchedule | None,
                               saved_names: tuple[str | None, ...] | None = None,
                               rounding: AllocatorRounding = EXACT, adjacent_reuse: bool = True) -> LivenessTimeline:
    """Timeline of live bytes as Inductor's wrapper runs `fw` then `bw`: over its kernels in its
    order (passes/inductor_schedule.py), each kernel one step that allocates all its buffers
    before any of its inputs is freed. `fw`/`bw` are the graphs the schedules were built from
    (after Inductor's post-grad passes): their placeholders, outputs and library kernels' nodes.
    The same rules as analyze_liveness otherwise: storages freed after their last reader, unless
    handed on; a result written over a dying input of the same size; freed buffers held for a
    later allocation of the same size and dtype (_pool_reuses); each allocation holding what
    `rounding` says its block holds. `adjacent_reuse`: the wrapper reuses a dead buffer only for
    the next kernel's allocation (memcompile's rule, _torch_private.InductorRules.adjacent_reuse_applies)."""
    storages: dict[str, _Storage] = {}
    steps: list[LiveStep] = []
    live: dict[str, _Storage] = {}
    peak = {"bytes": -1, "breakdown": ()}

    def record(phase: str, kernel: ScheduledKernel, graph: fx.GraphModule) -> None:
        transient = 0
        margin = OP_SCRATCH_BYTES if kernel.library_call else 0
        if kernel.extern_origin:
            # The library call's own workspace. Not layout_copy_bytes: Inductor hands it the
            # strides it accepts, realizing any copy as a buffer of its schedule (counted there);
            # attention's backward given strided views measured 32 KiB of scratch, not copies.
            origin = _node_named(graph, kernel.extern_origin)
            if origin is not None:
                transient = rounding.allocated_bytes(kernel_workspace_bytes(origin, inductor=True)
                                                     + promotion_copy_bytes(origin))
                if counted_exactly(origin):
                    margin = 0
        _record_step(steps, peak, live, phase, kernel.name, margin + transient)

    def walk(phase: str, graph: fx.GraphModule, schedule: InductorSchedule, prefix: str,
             input_key) -> dict[str, str]:
        """Register the phase's storages; returns {Inductor name: storage key}."""
        key_of: dict[str, str] = {}
        for node in graph.graph.nodes:
            if node.op == "placeholder":
                key = input_key(node)
                if key is not None:
                    key_of[node.name] = key
                    if node.name in schedule.unaligned_inputs:  # as this phase's graph sees it
                        storages[key].aligned = False
        for kernel in schedule.kernels:
            for buf in kernel.allocates:
                key = prefix + buf.name
                key_of[buf.name] = key
                label = kernel.name if len(kernel.allocates) == 1 else f"{kernel.name} [{buf.name}]"
                storages[key] = _Storage(buf.nbytes, TEMPORARY, dtype=buf.dtype, aligned=buf.aligned, label=label,
                                         held=rounding.allocated_bytes(buf.nbytes))
        return key_of

    def run(phase: str, graph: fx.GraphModule, schedule: InductorSchedule, key_of: dict[str, str]) -> None:
        kernels = list(schedule.kernels)
        for step, kernel in enumerate(kernels):
            for name in kernel.reads:
                key = key_of.get(name)
                if key is not None and key in storages:
                    storages[key].last_step = max(storages[key].last_step, step)
        creates = {k: [key_of[b.name] for b in k.allocates] for k in kernels}
        donors: dict[ScheduledKernel, dict[str, list[str]]] = {}
        for k in kernels:
            for result, donor in k.in_place_candidates:
                if donor in key_of and result in key_of and key_of[result] in creates[k]:
                    donors.setdefault(k, {}).setdefault(key_of[result], []).append(key_of[donor])
        allocates = frozenset(k for k in kernels if k.wrapper_allocates)
        _run_phase(phase, kernels, creates, live, storages, lambda ph, k: record(ph, k, graph), donors, allocates,
                   (schedule.peak_estimate, schedule.overall_peak_estimate), _frees_after(kernels), adjacent_reuse)

    # ---- forward
    def fw_input(node: fx.Node) -> str:
        key = node.name
        nbytes = tensor_nbytes(node.meta.get("val"))
        storages[key] = _Storage(nbytes, STATIC, pinned=True, dtype=str(getattr(node.meta.get("val"), "dtype", None)),
                                 held=rounding.allocated_bytes(nbytes))
        return key

    fw_keys = walk("forward", fw, fw_schedule, "", fw_input)
    fw_out_args = list(fw.graph.find_nodes(op="output")[0].args[0])
    if len(fw_out_args) != len(fw_schedule.outputs):
        raise ValueError(f"forward schedule has {len(fw_schedule.outputs)} outputs, the graph {len(fw_out_args)}")
    handed_on = _hand_on_outputs([(i, arg, fw_keys.get(name) if name is not None else None)
                                  for i, (arg, name) in enumerate(zip(fw_out_args, fw_schedule.outputs))
                                  if isinstance(arg, fx.Node)], storages, live, num_fwd_outputs, saved_names)
    static_bytes = sum(s.held for s in live.values())
    run("forward", fw, fw_schedule, fw_keys)

    # ---- backward
    if bw is not None and bw_schedule is not None:
        def bw_input(node: fx.Node) -> str | None:
            # tangents are held until the backward returns (see analyze_liveness)
            if node.name in handed_on:
                return handed_on[node.name]
            if tp.is_tangent(node):
                key = f"bw:{node.name}"
                val = node.meta.get("val")
                nbytes = tensor_nbytes(val)
                storages[key] = _Storage(nbytes, TEMPORARY, from_input=True, pinned=True,
                                         dtype=str(getattr(val, "dtype", None)), held=rounding.allocated_bytes(nbytes))
                live[key] = storages[key]
                return key
            return None

        for key in handed_on.values():
            if storages[key].category == SAVED and not storages[key].user_visible:
                storages[key].pinned = False
                storages[key].last_step = -1
        bw_keys = walk("backward", bw, bw_schedule, "bw:", bw_input)
        bw_out_args = list(bw.graph.find_nodes(op="output")[0].args[0])
        if len(bw_out_args) != len(bw_schedule.outputs):
            raise ValueError(f"backward schedule has {len(bw_schedule.outputs)} outputs, the graph {len(bw_out_args)}")
        for name in bw_schedule.outputs:
            key = bw_keys.get(name) if name is not None else None
            if key is not None and storages[key].category != STATIC:
                storages[key].pinned = True
                storages[key].category = GRADIENT
        # last reads first, so saved tensors the backward never reads are dropped before it runs
        for step, kernel in enumerate(bw_schedule.kernels):
            for name in kernel.reads:
                key = bw_keys.get(name)
                if key is not None and key in storages:
                    storages[key].last_step = max(storages[key].last_step, step)
        for key in [k for k, s in live.items() if not s.pinned and s.last_step < 0]:
            del live[key]
        run("backward", bw, bw_schedule, bw_keys)

    if not steps:
        steps.append(LiveStep("forward", "<empty>", static_bytes))
        peak["breakdown"] = ((STATIC, static_bytes),)
    peak_index = max(range(len(steps)), key=lambda i: steps[i].live_bytes)
    return LivenessTimeline(tuple(steps), static_bytes, steps[peak_index].live_bytes, peak_index, peak["breakdown"],
                            peak.get("tensors", ()))


def _frees_after(kernels: list[ScheduledKernel]) -> tuple[bool, ...]:
    """Per kernel, whether the wrapper frees after it: after the last kernel of a C++ call that
    runs several (ScheduledKernel.call_group), after every other kernel."""
    return tuple(k.call_group < 0 or i + 1 == len(kernels) or kernels[i + 1].call_group != k.call_group
                 for i, k in enumerate(kernels))


def _record_step(steps: list, peak: dict, live: dict[str, _Storage], phase: str, name: str, scratch: int) -> None:
    """One step's live bytes (live storages plus the op's scratch), split by category; at a
    new peak, the breakdown and the largest storages live."""
    split = dict.fromkeys(CATEGORIES, 0)
    for s in live.values():
        split[s.category] += s.held
    split[SCRATCH] = scratch
    total = sum(split.values())
    steps.append(LiveStep(phase, name, total, tuple(split.values())))
    if total > peak["bytes"]:
        by_category: dict[str, int] = {}
        for s in live.values():
            by_category[s.category] = by_category.get(s.category, 0) + s.held
        by_category[SCRATCH] = scratch
        peak["bytes"] = total
        peak["breakdown"] = tuple(sorted(by_category.items()))
        largest = heapq.nlargest(PEAK_TENSORS, live.items(), key=lambda item: item[1].nbytes)
        peak["tensors"] = tuple((_label(key, s), s.category, s.nbytes) for key, s in largest if s.nbytes)


def _label(key: str, storage: _Storage) -> str:
    """A storage's name for the plan: its creator's (a forward node, or a backward one)."""
    name = storage.label or (key[3:] if key.startswith("bw:") else key)
    return f"{name} (backward)" if key.startswith("bw:") else name


def _hand_on_outputs(outputs: list[tuple[int, fx.Node, str | None]], storages: dict[str, _Storage],
                     live: dict[str, _Storage], num_fwd_outputs: int, saved_names) -> dict[str, str]:
    """The forward's outputs (index, node, storage key) stay live to the end of the forward: the
    user's outputs, and saved tensors handed on to the backward (returned: saved name -> key);
    static storages (parameters) are live from the start."""
    handed_on: dict[str, str] = {}
    for i, arg, key in outputs:
        if key is None or key not in storages:
            continue
        storage = storages[key]
        storage.pinned = True
        if storage.category != STATIC:
            storage.category = OUTPUT if i < num_fwd_outputs else SAVED
        storage.user_visible |= i < num_fwd_outputs
        if i >= num_fwd_outputs:
            handed_on[_saved_name(arg, i, saved_names)] = key
    for key, s in storages.items():
        if s.category == STATIC:
            live[key] = s
    return handed_on


def _saved_name(arg: fx.Node, index: int, saved_names: tuple[str | None, ...] | None) -> str:
    """The name the backward's placeholder for forward output `index` has."""
    if saved_names is not None and index < len(saved_names) and saved_names[index] is not None:
        return saved_names[index]
    return arg.name


def _node_named(gm: fx.GraphModule, name: str) -> fx.Node | None:
    for node in gm.graph.nodes:
        if node.name == name:
            return node
    return None


def with_held_at_backward_start(timeline: LivenessTimeline, nbytes: int) -> LivenessTimeline:
    """`timeline` with `nbytes` more live at the backward's first step, as scratch: what eager
    code between the forward's return and the backward's start holds beyond what the graphs do
    (a loss computed outside the compiled model). The forward's last step already holds what the
    backward starts with, so the first backward step stands for the gap between them."""
    start = timeline.backward_start()
    if not nbytes or start < 0:
        return timeline
    return with_scratch_at(timeline, start, nbytes)


def with_scratch_at(timeline: LivenessTimeline, index: int, nbytes: int) -> LivenessTimeline:
    """`timeline` with `nbytes` more live at its step `index`, as scratch (a larger working set
    of that step's node)."""
    step = timeline.steps[index]
    by_category = step.by_category
    if len(by_category) == len(CATEGORIES):
        by_category = tuple(b + (nbytes if c == SCRATCH else 0) for b, c in zip(by_category, CATEGORIES))
    steps = timeline.steps[:index] + (dataclasses.replace(step, live_bytes=step.live_bytes + nbytes,
                                                          by_category=by_category),) + timeline.steps[index + 1:]
    if steps[index].live_bytes <= timeline.peak_bytes:
        return dataclasses.replace(timeline, steps=steps)
    breakdown = tuple((c, b) for c, b in zip(CATEGORIES, by_category)) if len(by_category) == len(CATEGORIES) else ()
    return dataclasses.replace(timeline, steps=steps, peak_bytes=steps[index].live_bytes, peak_index=index,
                               peak_breakdown=breakdown, peak_tensors=())
