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
    writes_over_a_copy_of_its_first_input,
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


@dataclass(frozen=True, eq=False)
class _Phases:
    """The joint graph's nodes as the steps run them: the forward's, then the backward's."""

    nodes: tuple[fx.Node, ...]  # every node but the output
    primals: tuple[fx.Node, ...]
    forward_nodes: tuple[fx.Node, ...]
    backward_nodes: tuple[fx.Node, ...]
    required_fw: frozenset[fx.Node]  # run in the forward (the others there run only if kept)
    step: dict[fx.Node, int]
    root: dict[fx.Node, fx.Node]  # the node owning each node's storage (aliases count against it)
    user_outputs: frozenset[fx.Node]
    grad_outputs: frozenset[fx.Node]
    forward: frozenset[fx.Node]  # forward_nodes as a set
    backward: frozenset[fx.Node]  # backward_nodes as a set
    born: dict[fx.Node, int]  # the step allocating each node's result (a tuple member's: its op's)

    @property
    def num_steps(self) -> int:
        return len(self.forward_nodes) + len(self.backward_nodes)


def _phases(joint: fx.GraphModule, num_fwd_outputs: int, static_lifetime_input_indices: list[int]) -> _Phases:
    required_fw, required_bw, _ = tp.classify_joint_nodes(joint, num_fwd_outputs, static_lifetime_input_indices)
    # A member of a forward op's tuple exists once that op has run in the forward: attention's
    # log-sum-exp, read by the backward only. The stock classification calls such a getitem
    # unclaimed, which made it unkeepable ("computed in backward only") and so every solver plan
    # re-ran attention in the backward to get it (Llama small: two more attention kernels a step;
    # `python benchmarks/step_profile.py --model llama --budget 12467104` at 15a093a).
    required_fw |= {n for n in joint.graph.nodes if is_getitem(n) and n.args[0] in required_fw}
    nodes = tuple(n for n in joint.graph.nodes if n.op != "output")
    placeholders = {n for n in nodes if n.op == "placeholder"}
    backward_nodes = tuple(n for n in nodes if n in required_bw and n not in placeholders)
    forward_nodes = tuple(n for n in nodes if n not in required_bw and n not in placeholders)
    step = {n: i for i, n in enumerate(forward_nodes)}
    step.update({n: len(forward_nodes) + i for i, n in enumerate(backward_nodes)})
    root: dict[fx.Node, fx.Node] = {}
    for n in nodes:
        base = _alias_base(n)
        root[n] = root.get(base, base) if base is not None else n
    outputs = list(joint.graph.find_nodes(op="output")[0].args[0])
    born = {n: step[n.args[0]] if is_getitem(n) and n.args[0] in step else step[n] for n in step}
    return _Phases(nodes, tuple(n for n in nodes if tp.is_primal(n)), forward_nodes, backward_nodes,
                   frozenset(required_fw), step, root,
                   frozenset(a for a in outputs[:num_fwd_outputs] if isinstance(a, fx.Node)),
                   frozenset(a for a in outputs[num_fwd_outputs:] if isinstance(a, fx.Node)),
                   frozenset(forward_nodes), frozenset(backward_nodes), born)


def _is_tensor(n: fx.Node) -> bool:
    return isinstance(n.meta.get("val"), torch.Tensor)


def _recompute_inputs(n: fx.Node, forward: set[fx.Node] | frozenset[fx.Node]) -> list[fx.Node]:
    """The forward tensors recomputing `n` reads."""
    return [i for i in compute_unit(n).all_input_nodes if i in forward and _is_tensor(i)]


def _candidates(phases: _Phases) -> list[fx.Node]:
    """Forward tensors the backward reads, and (transitively) what recomputing them reads, in
    forward order."""
    forward = phases.forward
    frontier = [i for b in phases.backward_nodes for i in b.all_input_nodes if i in forward and _is_tensor(i)]
    found: set[fx.Node] = set()
    while frontier:
        n = frontier.pop()
        if n in found:
            continue
        found.add(n)
        frontier.extend(_recompute_inputs(n, forward))
    return [n for n in phases.forward_nodes if n in found]


@dataclass(frozen=True, eq=False)
class _Reads:
    """Storage-level first and last reads, per phase (steps; NEVER where not read)."""

    fw_last: dict[fx.Node, int]
    bw_first: dict[fx.Node, int]  # of candidates: recomputations are placed before their first FX reader
    bw_last: dict[fx.Node, int]


def _reads(phases: _Phases, candidates: set[fx.Node], reads_of) -> _Reads:
    fw_last: dict[fx.Node, int] = {}
    bw_first: dict[fx.Node, int] = {}
    bw_last: dict[fx.Node, int] = {}
    backward = phases.backward
    step, root = phases.step, phases.root
    for n in phases.nodes:
        for i in reads_of(n):
            r = root[i]
            if n in phases.required_fw:  # unclaimed forward-side nodes run in backward, if at all
                fw_last[r] = max(fw_last.get(r, NEVER), step[n])
            elif n in backward:
                for key in {r, i}:  # the storage and the node itself (views read directly)
                    bw_last[key] = max(bw_last.get(key, NEVER), step[n])
        if n in backward:
            for i in n.all_input_nodes:
                if i in candidates:
                    bw_first[i] = min(bw_first.get(i, phases.num_steps), step[n])
    for o in phases.user_outputs:
        fw_last[root[o]] = phases.num_steps - 1
    return _Reads(fw_last, bw_first, bw_last)


class _FixedBytes:
    """Bytes held whatever the plan decides, per step, as a difference array; and what each
    step's node allocates itself (its outputs, its scratch)."""

    def __init__(self, num_steps: int) -> None:
        self.delta = [0] * (num_steps + 1)
        self.allocated_by_node = [0] * num_steps

    def add(self, nbytes: int, start: int, end: int, by_node: bool = False) -> None:
        if nbytes and start <= end:
            self.delta[start] += nbytes
            self.delta[end + 1] -= nbytes
            if by_node:
                self.allocated_by_node[start] += nbytes

    def per_step(self) -> tuple[int, ...]:
        running, out = 0, []
        for change in self.delta[:-1]:
            running += change
            out.append(running)
        return tuple(out)


def _add_fixed_bytes(fixed: _FixedBytes, phases: _Phases, candidates: set[fx.Node], reads: _Reads,
                     inlined: frozenset[fx.Node], fuse: bool) -> None:
    """What no decision changes: parameters, tangents, each node's transients, and the
    non-candidates' results over their lifetimes."""
    step, root, last = phases.step, phases.root, phases.num_steps - 1
    backward_start = len(phases.forward_nodes)
    forward, backward, born = phases.forward, phases.backward, phases.born
    grad_roots = {root[g] for g in phases.grad_outputs}  # a gradient may be a view (e.g. of an mm's result)
    fixed.add(sum(tensor_nbytes(p.meta.get("val")) for p in phases.primals if root[p] is p), 0, last)
    for n in phases.nodes:
        if n.op == "placeholder" and tp.is_tangent(n):
            fixed.add(tensor_nbytes(n.meta.get("val")), backward_start, max(reads.bw_last.get(n, NEVER), backward_start))
    for n in phases.forward_nodes + phases.backward_nodes:
        unclaimed = n in forward and n not in phases.required_fw  # runs in forward only if kept
        if not unclaimed and n not in inlined:  # (then its transients are in the liveness check, not here)
            fixed.add(transient_bytes(n, inductor=fuse) + op_scratch_bytes(n), step[n], step[n], by_node=True)
        if root[n] is not n or n in inlined:
            continue  # aliases own no storage; inlined bodies own none either
        if not is_getitem(n) and isinstance(n.meta.get("val"), (tuple, list)):
            # Tuple producers: members nobody reads exist only while the op runs.
            read_members = {g.args[1] for g in n.users if is_getitem(g) and g.users}
            for k, member in enumerate(n.meta["val"]):
                if k not in read_members:
                    fixed.add(tensor_nbytes(member), step[n], step[n], by_node=True)
            continue
        size = tensor_nbytes(n.meta.get("val"))
        if n in backward:
            end = last if n in grad_roots else max(reads.bw_last.get(n, NEVER), step[n])
            # a scatter into a copy of a backward buffer dying at it takes that buffer over, as
            # Inductor's does: the GPT style file's tied embedding gradient, counted twice, held
            # 154 MB more at the backward's last step than its check under every plan
            taken_over = _takes_over_its_first_input(n, phases, reads, grad_roots)
            fixed.add(size, step[n] + 1 if taken_over else born[n], end, by_node=not taken_over)
        elif n not in candidates:
            fixed.add(size, step[n], max(reads.fw_last.get(n, NEVER), step[n]), by_node=True)


def _takes_over_its_first_input(n: fx.Node, phases: _Phases, reads: _Reads, grad_roots: set[fx.Node]) -> bool:
    """Whether backward node `n` writes over a copy of its first input (a scatter,
    graph_facts.writes_over_a_copy_of_its_first_input) whose buffer, made in the backward and of
    its size, dies at `n`: Inductor's copy then takes over that buffer (scheduler.decide_inplace_update)."""
    if not writes_over_a_copy_of_its_first_input(n) or not n.args or not isinstance(n.args[0], fx.Node):
        return False
    donor = phases.root[n.args[0]]
    return (donor in phases.backward and donor not in grad_roots and donor.op == "call_function"
            and reads.bw_last.get(donor) == phases.step[n]
            and tensor_nbytes(donor.meta.get("val")) == tensor_nbytes(n.meta.get("val")))


@dataclass
class _Rows:
    """The problem's per-candidate columns, filled one candidate at a time."""

    names: list = dataclasses.field(default_factory=list)
    nbytes: list = dataclasses.field(default_factory=list)
    costs: list = dataclasses.field(default_factory=list)
    can_keep: list = dataclasses.field(default_factory=list)
    can_recompute: list = dataclasses.field(default_factory=list)
    bans: list = dataclasses.field(default_factory=list)
    keep_bans: list = dataclasses.field(default_factory=list)
    first_read: list = dataclasses.field(default_factory=list)
    last_read: list = dataclasses.field(default_factory=list)
    keep_from: list = dataclasses.field(default_factory=list)
    recompute_from: list = dataclasses.field(default_factory=list)
    reads: list = dataclasses.field(default_factory=list)
    view_of: list = dataclasses.field(default_factory=list)
    created_at: list = dataclasses.field(default_factory=list)
    store_choices: list = dataclasses.field(default_factory=list)
    not_stored: list = dataclasses.field(default_factory=list)
    must_be_exact: list = dataclasses.field(default_factory=list)


def _recompute_and_keep_bans(c: fx.Node, base: fx.Node | None, phases: _Phases, pinned_bases: set[fx.Node],
                             primals: set[fx.Node], cost_s: float | None) -> tuple[str, str]:
    """Why `c` may not be recomputed, and why it may not be kept ('' where it may)."""
    ban = _recompute_ban(c)
    is_view_of_activation = base is not None and phases.root[c] not in primals
    if is_view_of_activation and ban == MUST_SAVE:
        ban = ""
    elif c in pinned_bases and not ban:
        ban = MUST_SAVE
    if not ban and cost_s is None:
        ban = NO_COST
    if ban and must_recompute(c):
        log.warning("memcompile: %s is marked MUST_RECOMPUTE but cannot be recomputed (%s): it is kept", c.name, ban)
        ban += "; its MUST_RECOMPUTE cannot be honoured"
    # Keeping a view of an activation would pin its base: recompute the (free) view instead.
    # Keeping an unclaimed node would run it (and its inputs' lifetimes) at the end of
    # forward, which the model does not describe: compute it in backward instead.
    # The user's MUST_RECOMPUTE forbids keeping, where recomputing is allowed at all.
    if ban:
        return ban, ""  # keeping is the only way left (the solver needs one of the two)
    if is_view_of_activation:
        return ban, VIEW_OF_ACTIVATION
    if must_recompute(c):
        return ban, MUST_RECOMPUTE_REASON
    if c not in phases.required_fw:
        return ban, "computed in backward only"
    return ban, ""


def _candidate_rows(phases: _Phases, candidates: list[fx.Node], reads: _Reads, fixed: _FixedBytes,
                    profile: DeviceProfile, store: StoreOptions, step_time_s: list[float]) -> _Rows:
    """Each candidate's sizes, costs, bans, windows and storage forms; adds the forward lifetime
    every decision shares to `fixed`."""
    step, root, num_steps = phases.step, phases.root, phases.num_steps
    backward_start = len(phases.forward_nodes)
    forward, born = phases.forward, phases.born
    index = {n: i for i, n in enumerate(candidates)}
    can_pin = [n in phases.required_fw and is_materialised(n) for n in phases.forward_nodes] if store.offload else []
    # MUST_SAVE on a view of an activation pins the storage it views: the base is saved and the
    # (free) view recomputed from it.
    pinned_bases = {root[c] for c in candidates
                    if _alias_base(c) is not None and checkpoint_policy(compute_unit(c)) == "MUST_SAVE"}
    primals = set(phases.primals)
    cost_of_unit: dict[fx.Node, float | None] = {}
    rows = _Rows()
    for c in candidates:
        base = _alias_base(c)
        own_bytes = 0 if base is not None else tensor_nbytes(c.meta.get("val"))
        in_forward = c in phases.required_fw
        fw_end = max(reads.fw_last.get(c, NEVER), step[c]) if in_forward else NEVER
        if in_forward and own_bytes:
            fixed.add(own_bytes, born[c], fw_end, by_node=True)  # forward lifetime: the same whatever we decide
        unit = compute_unit(c)
        if unit not in cost_of_unit:
            # Unclaimed nodes (forward values only the backward reads) run once either way:
            # computing them in backward is not a re-computation.
            cost_of_unit[unit] = _recompute_cost_s(unit, profile) if in_forward else 0.0
        ban, keep_ban = _recompute_and_keep_bans(c, base, phases, pinned_bases, primals, cost_of_unit[unit])
        rows.names.append(c.name)
        rows.nbytes.append(own_bytes)
        rows.costs.append(cost_of_unit[unit] or 0.0)
        rows.can_keep.append(keep_ban == "")
        rows.keep_bans.append(keep_ban)
        rows.can_recompute.append(ban == "")
        rows.bans.append(ban)
        rows.first_read.append(reads.bw_first.get(c, num_steps))
        rows.last_read.append(reads.bw_last.get(c, NEVER))
        rows.keep_from.append(fw_end + 1 if in_forward else step[c])
        rows.recompute_from.append(max(backward_start, fw_end + 1))
        rows.reads.append(tuple(sorted({index[i] for i in _recompute_inputs(c, forward)})))
        rows.view_of.append(index[base] if base in index else -1)
        rows.created_at.append(step[c])
        if rows.can_keep[-1] and rows.keep_from[-1] < num_steps:  # held across the gap: other forms may apply
            choices, why = store_choices_for(c, own_bytes, profile, store)
            choices = tuple(_with_transfer_window(ch, step[c], fw_end, reads.bw_first.get(c, num_steps),
                                                  phases.forward_nodes, step_time_s, can_pin) for ch in choices)
        else:
            choices, why = (), ""
        rows.store_choices.append(choices)
        rows.not_stored.append(why)
        rows.must_be_exact.append(any(error_sensitivity(c, fmt) for fmt in store.formats))
    return rows


def _same_op_groups(candidates: list[fx.Node], rows: _Rows, reads: _Reads) -> list[int]:
    """Results of one multi-result op that the backward reads (attention's output and
    log-sum-exp) are recomputed together or not at all: one run of the op makes them all. Per
    candidate, the first of its group (-1: none); the op's time is charged to that one only
    (rows.costs is changed so)."""
    same_op_as = [-1] * len(candidates)
    groups: dict[fx.Node, list[int]] = {}
    for i, c in enumerate(candidates):
        if is_getitem(c) and rows.can_recompute[i] and c in reads.bw_first:
            groups.setdefault(compute_unit(c), []).append(i)
    for members in groups.values():
        if len(members) > 1:
            for i in members:
                same_op_as[i] = members[0]
                rows.costs[i] = rows.costs[i] if i == members[0] else 0.0
    return same_op_as


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
    phases = _phases(joint, num_fwd_outputs, static_lifetime_input_indices)
    candidates = _candidates(phases)
    candidate_set = set(candidates)
    # Inductor's buffers. Candidates are saved (forward outputs) or recomputed: counted as buffers
    # here whatever the decision, an upper bound the exact check of the rewritten graphs refines.
    inlined: frozenset[fx.Node] = frozenset()
    either: frozenset[fx.Node] = frozenset()
    if fuse:
        prediction = predict_fusion(fusion_facts(joint, forced_outputs=candidate_set),
                                    FusionRules.for_device(graph_device_type(joint)))
        by_name = {n.name: n for n in phases.nodes}
        inlined = frozenset(by_name[n] for n in prediction.inlined if n in by_name)
        either = frozenset(by_name[n] for n in prediction.either if n in by_name)

    def reads_of(n: fx.Node) -> list[fx.Node]:
        """What `n`'s kernel reads; an inlined node reads nothing itself (its consumers do)."""
        if n in inlined:
            return []
        return effective_reads(n, inlined, either) if fuse else list(n.all_input_nodes)

    reads = _reads(phases, candidate_set, reads_of)
    fixed = _FixedBytes(phases.num_steps)
    _add_fixed_bytes(fixed, phases, candidate_set, reads, inlined, fuse)
    backward = phases.backward
    # Estimated run time of each step's node: how long an offload copy overlaps compute.
    step_time_s = [estimate_node_time_s(n, profile) if (n in phases.required_fw or n in backward) else 0.0
                   for n in phases.forward_nodes + phases.backward_nodes] if store.offload else [0.0] * phases.num_steps
    rows = _candidate_rows(phases, candidates, reads, fixed, profile, store, step_time_s)
    same_op_as = _same_op_groups(candidates, rows, reads)
    fixed_bytes = fixed.per_step()
    backward_start = len(phases.forward_nodes)
    stores = any(rows.store_choices)
    problem = ActivationProblem(
        names=tuple(rows.names),
        nbytes=tuple(rows.nbytes),
        recompute_cost_s=tuple(rows.costs),
        can_keep=tuple(rows.can_keep),
        can_recompute=tuple(rows.can_recompute),
        first_read=tuple(rows.first_read),
        last_read=tuple(rows.last_read),
        keep_from=tuple(rows.keep_from),
        recompute_from=tuple(rows.recompute_from),
        recompute_reads=tuple(rows.reads),
        view_of=tuple(rows.view_of),
        fixed_bytes=fixed_bytes,
        fixed_before_node_bytes=tuple(f - b for f, b in zip(fixed_bytes, fixed.allocated_by_node)),
        store_choices=tuple(rows.store_choices) if stores else (),
        created_at=tuple(rows.created_at) if stores else (),
        must_be_exact=tuple(rows.must_be_exact) if stores and any(rows.must_be_exact) else (),
        # Copies hide behind only part of the compute (profile.copy_overlap, measured).
        forward_compute_s=profile.copy_overlap * sum(step_time_s[:backward_start]),
        backward_compute_s=profile.copy_overlap * sum(step_time_s[backward_start:]),
        same_op_as=tuple(same_op_as) if any(g >= 0 for g in same_op_as) else (),
    )
    return JointAnalysis(
        problem=problem,
        candidates=tuple(candidates),
        primals=phases.primals,
        forward_nodes=phases.forward_nodes,
        backward_nodes=phases.backward_nodes,
        static_lifetime_inputs=frozenset(tp.static_lifetime_nodes(joint, static_lifetime_input_indices)),
        cannot_recompute_reason=tuple(rows.bans),
        cannot_keep_reason=tuple(rows.keep_bans),
        not_stored_reason=tuple(rows.not_stored),
    )
