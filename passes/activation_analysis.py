"""From the joint forward+backward graph to the solver's plain ActivationProblem.

Steps are the forward nodes in joint order, then the backward nodes in joint order (the order
AOTAutograd runs them; recomputed nodes are slotted in just before their first backward reader).
"""

from __future__ import annotations

import logging
import dataclasses
from dataclasses import dataclass

import torch
import torch.fx as fx

from memcompile import _torch_private as tp
from memcompile.cost_models.device import DeviceProfile
from memcompile.cost_models.node_cost import estimate_node_time_s
from memcompile.cost_models.transient_memory import transient_bytes
from memcompile.node_facts import is_aliasing_op, is_getitem, tensor_nbytes
from memcompile.passes.fusion import FusionRules, predict_fusion
from memcompile.passes.graph_facts import (
    checkpoint_policy,
    effective_reads,
    fusion_facts,
    graph_device_type,
    is_builtin_op,
    is_mutating_op,
    is_random_op,
)
from memcompile.passes.liveness import op_scratch_bytes
from memcompile.passes.stored_forms import StoreOptions, error_sensitivity, is_materialised, store_choices_for
from memcompile.plan import Choice
from memcompile.solver.activations import ActivationProblem, StoreChoice
from memcompile.errors import UNREADABLE_GRAPH_ERRORS

_DEFAULT_STORE = StoreOptions()  # the defaults: what analyze_joint_graph offers unless told

NEVER = -1
log = logging.getLogger("memcompile")


@dataclass(frozen=True)
class JointAnalysis:
    """The problem plus what is needed to map decisions back onto the joint graph."""

    problem: ActivationProblem
    candidates: tuple[fx.Node, ...]
    primals: tuple[fx.Node, ...]
    forward_nodes: tuple[fx.Node, ...]
    backward_nodes: tuple[fx.Node, ...]
    static_lifetime_inputs: frozenset[fx.Node]
    cannot_recompute_reason: tuple[str, ...]
    cannot_keep_reason: tuple[str, ...] = ()
    not_stored_reason: tuple[str, ...] = ()  # why quantize/offload were not offered, per candidate
    boundary_bytes: int = 0  # held by eager code as the backward starts, in the problem (Options.boundary_bytes)


def compute_unit(node: fx.Node) -> fx.Node:
    """The node that actually runs when `node` is recomputed (a getitem's tuple producer)."""
    return node.args[0] if is_getitem(node) else node


def _alias_base(node: fx.Node) -> fx.Node | None:
    """The node whose storage `node` shares, if it is a view (directly or via a view tuple)."""
    unit = compute_unit(node)
    if is_aliasing_op(unit) and unit.args and isinstance(unit.args[0], fx.Node):
        return unit.args[0]
    return None


# Reasons a candidate may not be recomputed (shown in the plan's decisions).
RANDOM_OP = "random op (recomputing would draw new random numbers; kept instead)"
MUTATES = "mutates its input"
MUST_SAVE = "marked MUST_SAVE (checkpoint policy)"
OFFLOAD_TAG = "marked *_CPU_OFFLOAD (checkpoint policy): saved, not recomputed"
UNKNOWN_OP = "op outside aten/prims (custom or higher-order op): purity and cost unknown"
NO_COST = "its recompute cost could not be estimated"
VIEW_OF_ACTIVATION = "view of an activation: keeping it would pin its base"
MUST_RECOMPUTE_REASON = "marked MUST_RECOMPUTE (checkpoint policy)"


def _recompute_ban(node: fx.Node) -> str:
    """Why `node` may not be recomputed in backward ('' when it may).

    Everything downstream of a random op stays recomputable: it is recomputed from the kept
    random tensor, so it sees the same numbers (e.g. a dropout mask from a kept `rand`).
    """
    unit = compute_unit(node)
    if unit.op != "call_function":
        return "not an op"
    if is_random_op(unit):
        return RANDOM_OP
    if is_mutating_op(unit):
        return MUTATES
    policy = checkpoint_policy(unit)
    if policy == "MUST_SAVE":
        return MUST_SAVE
    if policy.endswith("CPU_OFFLOAD"):
        return OFFLOAD_TAG
    if not is_builtin_op(unit):
        return UNKNOWN_OP
    return ""


def must_recompute(node: fx.Node) -> bool:
    """The user's MUST_RECOMPUTE: never kept (when it can be recomputed at all).

    PREFER_SAVE / PREFER_RECOMPUTE (plain `checkpoint()` tags every op PREFER_RECOMPUTE) are
    preferences the budget overrides: the solver already picks the fastest plan that fits, so
    they do not enter the problem.
    """
    return checkpoint_policy(compute_unit(node)) == "MUST_RECOMPUTE"


def _recompute_cost_s(unit: fx.Node, profile: DeviceProfile) -> float | None:
    """Roofline time of one run of `unit`; None when the cost model cannot read the node."""
    try:
        return float(estimate_node_time_s(unit, profile))
    except UNREADABLE_GRAPH_ERRORS:  # an op the cost model does not know must not fail the compile
        return None


def _with_transfer_window(choice: StoreChoice, created: int, forward_end: int, first_read: int,
                          forward_nodes: tuple, step_time_s: list[float], can_pin: list[bool]) -> StoreChoice:
    """An offload's copy windows on the step grid: the device copy is held until the copy out
    has had the forward compute after its producer to run behind, never before its last forward
    reader, and up to a node the wait can depend on (`can_pin`: materialised, in the forward)
    so compilers keep it there (release step; -1 where none: the wait follows the last reader);
    the reload is issued early enough that the backward compute before its first reader covers
    it (prefetch steps). Each copy is timed alone: copies queued behind others finish later
    than this, which costs time (the link term), not memory."""
    if choice.kind != Choice.OFFLOAD:
        return choice
    release, overlapped = created, 0.0
    last_forward = len(forward_nodes) - 1
    while overlapped < choice.link_s and release < last_forward:
        release += 1
        overlapped += step_time_s[release]
    release = max(release, forward_end)
    while release <= last_forward and not can_pin[release]:
        release += 1
    prefetch, overlapped = 0, 0.0
    backward_start = len(forward_nodes)
    while overlapped < choice.link_s and first_read - prefetch - 1 >= backward_start:
        prefetch += 1
        overlapped += step_time_s[first_read - prefetch]
    return dataclasses.replace(choice, release_step=release if release <= last_forward else -1,
                               prefetch_steps=prefetch)


def analyze_joint_graph(
    joint: fx.GraphModule,
    num_fwd_outputs: int,
    static_lifetime_input_indices: list[int],
    profile: DeviceProfile,
    store: StoreOptions = _DEFAULT_STORE,
    fuse: bool = False,
) -> JointAnalysis:
    """`fuse`: the graphs go to Inductor, so temporaries it inlines (passes/fusion.py) hold no
    buffer and their inputs are read when their consumers run (as the liveness check counts)."""
    required_fw, required_bw, _ = tp.classify_joint_nodes(
        joint, num_fwd_outputs, static_lifetime_input_indices
    )
    # A member of a forward op's tuple exists once that op has run in the forward: attention's
    # log-sum-exp, read by the backward only. The stock classification calls such a getitem
    # unclaimed, which made it unkeepable ("computed in backward only") and so every solver plan
    # re-ran attention in the backward to get it (Llama small: two more attention kernels a step;
    # `python benchmarks/step_profile.py --model llama --budget 12467104` at 15a093a).
    required_fw |= {n for n in joint.graph.nodes if is_getitem(n) and n.args[0] in required_fw}
    nodes = [n for n in joint.graph.nodes if n.op != "output"]
    primals = tuple(n for n in nodes if tp.is_primal(n))
    primal_set = set(primals)
    placeholders = {n for n in nodes if n.op == "placeholder"}
    backward_nodes = tuple(n for n in nodes if n in required_bw and n not in placeholders)
    forward_nodes = tuple(n for n in nodes if n not in required_bw and n not in placeholders)
    step = {n: i for i, n in enumerate(forward_nodes)}
    step.update({n: len(forward_nodes) + i for i, n in enumerate(backward_nodes)})
    num_steps = len(forward_nodes) + len(backward_nodes)
    last = num_steps - 1
    fw_set, bw_set = set(forward_nodes), set(backward_nodes)

    out_node = joint.graph.find_nodes(op="output")[0]
    outputs = list(out_node.args[0])
    user_outputs = {a for a in outputs[:num_fwd_outputs] if isinstance(a, fx.Node)}
    grad_outputs = {a for a in outputs[num_fwd_outputs:] if isinstance(a, fx.Node)}

    # Storage roots: aliases count against the storage they view.
    root: dict[fx.Node, fx.Node] = {}
    for n in nodes:
        base = _alias_base(n)
        root[n] = root.get(base, base) if base is not None else n

    # Candidates: forward tensors the backward reads, and (transitively) what recomputing them reads.
    def is_tensor(n: fx.Node) -> bool:
        return isinstance(n.meta.get("val"), torch.Tensor)

    def recompute_inputs(n: fx.Node) -> list[fx.Node]:
        return [i for i in compute_unit(n).all_input_nodes if i in fw_set and is_tensor(i)]

    direct = {i for b in backward_nodes for i in b.all_input_nodes if i in fw_set and is_tensor(i)}
    candidate_set: set[fx.Node] = set()
    frontier = list(direct)
    while frontier:
        n = frontier.pop()
        if n in candidate_set:
            continue
        candidate_set.add(n)
        frontier.extend(recompute_inputs(n))
    candidates = [n for n in forward_nodes if n in candidate_set]
    index = {n: i for i, n in enumerate(candidates)}

    # Inductor's buffers. Candidates are saved (forward outputs) or recomputed: counted as buffers
    # here whatever the decision, an upper bound the exact check of the rewritten graphs refines.
    inlined: frozenset[fx.Node] = frozenset()
    either: frozenset[fx.Node] = frozenset()
    if fuse:
        prediction = predict_fusion(fusion_facts(joint, forced_outputs=candidate_set),
                                    FusionRules.for_device(graph_device_type(joint)))
        by_name = {n.name: n for n in nodes}
        inlined = frozenset(by_name[n] for n in prediction.inlined if n in by_name)
        either = frozenset(by_name[n] for n in prediction.either if n in by_name)

    def reads_of(n: fx.Node) -> list[fx.Node]:
        """What `n`'s kernel reads; an inlined node reads nothing itself (its consumers do)."""
        if n in inlined:
            return []
        return effective_reads(n, inlined, either) if fuse else list(n.all_input_nodes)

    # Storage-level first/last reads, per phase.
    fw_last_read: dict[fx.Node, int] = {}
    bw_first_read: dict[fx.Node, int] = {}
    bw_last_read: dict[fx.Node, int] = {}
    for n in nodes:
        for i in reads_of(n):
            r = root[i]
            if n in required_fw:  # unclaimed forward-side nodes run in backward, if at all
                fw_last_read[r] = max(fw_last_read.get(r, NEVER), step[n])
            elif n in bw_set:
                for key in {r, i}:  # the storage and the node itself (views read directly)
                    bw_last_read[key] = max(bw_last_read.get(key, NEVER), step[n])
        if n in bw_set:
            for i in n.all_input_nodes:  # recomputations are placed before the first FX reader
                if i in candidate_set:
                    bw_first_read[i] = min(bw_first_read.get(i, num_steps), step[n])
    for o in user_outputs:
        fw_last_read[root[o]] = last

    fixed = [0] * (num_steps + 1)
    allocated_by_node = [0] * num_steps  # what each step's node allocates (its outputs, its scratch)
    grad_roots = {root[g] for g in grad_outputs}  # a gradient may be a view (e.g. of an mm's result)
    # A tuple member is allocated by the op that returns the tuple, not by its getitem.
    born = {n: step[n.args[0]] if is_getitem(n) and n.args[0] in step else step[n] for n in step}

    def add(nbytes: int, start: int, end: int, by_node: bool = False) -> None:
        if nbytes and start <= end:
            fixed[start] += nbytes
            fixed[end + 1] -= nbytes
            if by_node:
                allocated_by_node[start] += nbytes

    static_bytes = sum(tensor_nbytes(p.meta.get("val")) for p in primals if root[p] is p)
    add(static_bytes, 0, last)
    for n in nodes:
        if n.op == "placeholder" and tp.is_tangent(n):
            add(tensor_nbytes(n.meta.get("val")), len(forward_nodes), max(bw_last_read.get(n, NEVER), len(forward_nodes)))
    for n in forward_nodes + backward_nodes:
        unclaimed = n in fw_set and n not in required_fw  # runs in forward only if kept
        if not unclaimed and n not in inlined:  # (then its transients are in the liveness check, not here)
            add(transient_bytes(n, inductor=fuse) + op_scratch_bytes(n), step[n], step[n], by_node=True)
        if root[n] is not n or n in inlined:
            continue  # aliases own no storage; inlined bodies own none either
        if not is_getitem(n) and isinstance(n.meta.get("val"), (tuple, list)):
            # Tuple producers: members nobody reads exist only while the op runs.
            read_members = {g.args[1] for g in n.users if is_getitem(g) and g.users}
            for k, member in enumerate(n.meta["val"]):
                if k not in read_members:
                    add(tensor_nbytes(member), step[n], step[n], by_node=True)
            continue
        size = tensor_nbytes(n.meta.get("val"))
        if n in bw_set:
            end = last if n in grad_roots else max(bw_last_read.get(n, NEVER), step[n])
            add(size, born[n], end, by_node=True)
        elif n not in candidate_set:
            end = fw_last_read.get(n, NEVER)
            add(size, step[n], max(end, step[n]), by_node=True)

    # Estimated run time of each step's node: how long an offload copy overlaps compute.
    step_time_s = [estimate_node_time_s(n, profile) if (n in required_fw or n in bw_set) else 0.0
                   for n in forward_nodes + backward_nodes] if store.offload else [0.0] * num_steps
    can_pin = [n in required_fw and is_materialised(n) for n in forward_nodes] if store.offload else []
    store_choices, created_at, not_stored, must_be_exact = [], [], [], []
    names, nbytes, costs, can_keep, can_recompute, bans, keep_bans = [], [], [], [], [], [], []
    first_read, last_read, keep_from, recompute_from, reads, view_of = [], [], [], [], [], []
    cost_of_unit: dict[fx.Node, float | None] = {}
    backward_start = len(forward_nodes)
    # MUST_SAVE on a view of an activation pins the storage it views: the base is saved and the
    # (free) view recomputed from it.
    pinned_bases = {root[c] for c in candidates
                    if _alias_base(c) is not None and checkpoint_policy(compute_unit(c)) == "MUST_SAVE"}
    for c in candidates:
        base = _alias_base(c)
        own_bytes = 0 if base is not None else tensor_nbytes(c.meta.get("val"))
        in_forward = c in required_fw
        fw_end = max(fw_last_read.get(c, NEVER), step[c]) if in_forward else NEVER
        if in_forward and own_bytes:
            add(own_bytes, born[c], fw_end, by_node=True)  # forward lifetime: the same whatever we decide
        unit = compute_unit(c)
        if unit not in cost_of_unit:
            # Unclaimed nodes (forward values only the backward reads) run once either way:
            # computing them in backward is not a re-computation.
            cost_of_unit[unit] = _recompute_cost_s(unit, profile) if in_forward else 0.0
        ban = _recompute_ban(c)
        is_view_of_activation = base is not None and root[c] not in primal_set
        if is_view_of_activation and ban == MUST_SAVE:
            ban = ""
        elif c in pinned_bases and not ban:
            ban = MUST_SAVE
        if not ban and cost_of_unit[unit] is None:
            ban = NO_COST
        if ban and must_recompute(c):
            log.warning("memcompile: %s is marked MUST_RECOMPUTE but cannot be recomputed (%s): it is kept",
                        c.name, ban)
            ban += "; its MUST_RECOMPUTE cannot be honoured"
        cost = cost_of_unit[unit] or 0.0
        names.append(c.name)
        nbytes.append(own_bytes)
        costs.append(cost)
        # Keeping a view of an activation would pin its base: recompute the (free) view instead.
        # Keeping an unclaimed node would run it (and its inputs' lifetimes) at the end of
        # forward, which the model does not describe: compute it in backward instead.
        # The user's MUST_RECOMPUTE forbids keeping, where recomputing is allowed at all.
        if ban:
            keep_ban = ""  # keeping is the only way left (the solver needs one of the two)
        elif is_view_of_activation:
            keep_ban = VIEW_OF_ACTIVATION
        elif must_recompute(c):
            keep_ban = MUST_RECOMPUTE_REASON
        elif not in_forward:
            keep_ban = "computed in backward only"
        else:
            keep_ban = ""
        can_keep.append(keep_ban == "")
        keep_bans.append(keep_ban)
        can_recompute.append(ban == "")
        bans.append(ban)
        first_read.append(bw_first_read.get(c, num_steps))
        last_read.append(bw_last_read.get(c, NEVER))
        keep_from.append(fw_end + 1 if in_forward else step[c])
        recompute_from.append(max(backward_start, fw_end + 1))
        reads.append(tuple(sorted({index[i] for i in recompute_inputs(c)})))
        view_of.append(index[base] if base in index else -1)
        created_at.append(step[c])
        if can_keep[-1] and keep_from[-1] < num_steps:  # held across the gap: other forms may apply
            choices, why = store_choices_for(c, own_bytes, profile, store)
            choices = tuple(_with_transfer_window(ch, step[c], fw_end, bw_first_read.get(c, num_steps),
                                                  forward_nodes, step_time_s, can_pin) for ch in choices)
        else:
            choices, why = (), ""
        store_choices.append(choices)
        not_stored.append(why)
        must_be_exact.append(any(error_sensitivity(c, fmt) for fmt in store.formats))

    running, fixed_bytes = 0, []
    for t in range(num_steps):
        running += fixed[t]
        fixed_bytes.append(running)
    fixed_before = tuple(f - b for f, b in zip(fixed_bytes, allocated_by_node))
    # Results of one multi-result op that the backward reads (attention's output and log-sum-exp)
    # are recomputed together or not at all: one run of the op makes them all. Its time is
    # charged once, to the first of them.
    same_op_as = [-1] * len(candidates)
    groups: dict[fx.Node, list[int]] = {}
    for i, c in enumerate(candidates):
        if is_getitem(c) and can_recompute[i] and c in bw_first_read:
            groups.setdefault(compute_unit(c), []).append(i)
    for members in groups.values():
        if len(members) > 1:
            for i in members:
                same_op_as[i] = members[0]
                costs[i] = costs[i] if i == members[0] else 0.0
    problem = ActivationProblem(
        names=tuple(names),
        nbytes=tuple(nbytes),
        recompute_cost_s=tuple(costs),
        can_keep=tuple(can_keep),
        can_recompute=tuple(can_recompute),
        first_read=tuple(first_read),
        last_read=tuple(last_read),
        keep_from=tuple(keep_from),
        recompute_from=tuple(recompute_from),
        recompute_reads=tuple(reads),
        view_of=tuple(view_of),
        fixed_bytes=tuple(fixed_bytes),
        fixed_before_node_bytes=fixed_before,
        store_choices=tuple(store_choices) if any(store_choices) else (),
        created_at=tuple(created_at) if any(store_choices) else (),
        must_be_exact=tuple(must_be_exact) if any(store_choices) and any(must_be_exact) else (),
        # Copies hide behind only part of the compute (profile.copy_overlap, measured).
        forward_compute_s=profile.copy_overlap * sum(step_time_s[:backward_start]),
        backward_compute_s=profile.copy_overlap * sum(step_time_s[backward_start:]),
        same_op_as=tuple(same_op_as) if any(g >= 0 for g in same_op_as) else (),
    )
    return JointAnalysis(
        problem=problem,
        candidates=tuple(candidates),
        primals=primals,
        forward_nodes=forward_nodes,
        backward_nodes=backward_nodes,
        static_lifetime_inputs=frozenset(tp.static_lifetime_nodes(joint, static_lifetime_input_indices)),
        cannot_recompute_reason=tuple(bans),
        cannot_keep_reason=tuple(keep_bans),
        not_stored_reason=tuple(not_stored),
    )
