"""The compiler's choice per saved activation: keep it, recompute it in backward, or store it
in another form until backward (quantized, or offloaded to host memory).

A plain problem object (no torch types). Candidates are forward tensors the backward may need;
steps are the forward-then-backward execution order. The CP-SAT model (docs/design.md):

    k_i, r_i, q_ik in {0,1}    candidate i is kept / recomputed / stored with store choice k
    k_i + r_i + sum_k q_ik = 1           if backward reads i directly; <= 1 otherwise
    k_i + r_i + sum_k q_ik >= r_c        for every c whose recomputation reads i
    s_i = placement: just before i's first reader (direct, or a recomputed reader c)
    e_i >= last read of i (direct, or by a recomputed reader c; e_c if c is a view of i or
           fused: inlined into its readers, which read i in its place)
    kept i:        interval [keep_from_i, e_i]             presence k_i, demand bytes_i
                   (from created_i where i is a forward buffer only when saved)
    recomputed i:  interval [s_i, e_i]                     presence r_i and not fused_i, demand bytes_i
    quantized i:   interval [created_i, s_i]               presence q_ik, demand stored_bytes_ik
                   (+ one slot of conversion scratch at created_i and at s_i)
                   interval [s_i, e_i] (dequantized)       presence q_ik, demand bytes_i
    offloaded i:   interval [keep_from_i, release_i]       presence q_ik, demand bytes_i (copy-out in flight)
                   interval [s_i - prefetch_i, e_i]        presence q_ik, demand bytes_i (reloaded)
    cumulative(intervals + fixed_bytes profile) <= budget          at every step
    minimise  sum_i r_i cost_i + sum_ik q_ik cost_ik
              + max(0, offloaded link time - forward compute) + max(0, same - backward compute)

`evaluate` computes the tightest s/e for given decisions (materialisation placed just before
the first reader, as the rewrite does), so the model never claims less memory than that placement.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from dataclasses import dataclass

from ortools.sat.python import cp_model

from memcompile.plan import Choice, StatusKind, status_text
from memcompile.solver.cpsat import run_model

# Recompute costs enter CP-SAT as integers in units of 10 ns; each recompute also costs one unit
# so free recomputes (views) are not chosen gratuitously.
_TIME_UNIT_S = 1e-8


@dataclass(frozen=True)
class StoreChoice:
    """Holding a candidate until backward in another form than itself."""

    kind: Choice  # QUANTIZE (compressed copy on the device) | OFFLOAD (copy in host memory)
    format: str  # quantize: "int8" | "fp8" | "bf16"; offload: "host"
    stored_bytes: int  # device bytes while stored: the compressed copy and its scales; 0 for offload
    time_cost_s: float  # added step time of this choice for this tensor alone (kernels, exposed transfer)
    link_s: float = 0.0  # offload: seconds of host-link time per direction (shared by all offloads)
    prefetch_steps: int = 0  # offload: the reload starts this many steps before the tensor is needed
    release_step: int = -1  # offload: last forward step the device copy is held (copy-out in flight)
    store_transient_bytes: int = 0  # scratch of the conversion, at the producer's slot
    load_transient_bytes: int = 0  # scratch of the conversion back, at its materialisation slot


@dataclass(frozen=True)
class ActivationProblem:
    names: tuple[str, ...]  # in topological order
    nbytes: tuple[int, ...]  # storage each candidate owns (0 for views)
    recompute_cost_s: tuple[float, ...]
    can_keep: tuple[bool, ...]
    can_recompute: tuple[bool, ...]
    first_read: tuple[int, ...]  # first backward step reading i directly; num_steps if none
    last_read: tuple[int, ...]  # last backward step reading i or an alias of it; -1 if none
    keep_from: tuple[int, ...]  # first step a kept i is live beyond its forward lifetime
    recompute_from: tuple[int, ...]  # earliest step a recomputed i can start being live extra
    recompute_reads: tuple[tuple[int, ...], ...]  # candidates that recomputing i reads
    view_of: tuple[int, ...]  # index of the candidate whose storage i views, or -1
    fixed_bytes: tuple[int, ...]  # live bytes per step that no decision changes
    # Optional: other ways to hold a candidate until backward (empty tuple: none for anybody).
    store_choices: tuple[tuple[StoreChoice, ...], ...] = ()
    created_at: tuple[int, ...] = ()  # forward step producing each candidate (needed with store_choices)
    forward_compute_s: float = 0.0  # compute time a forward copy-out can hide behind
    backward_compute_s: float = 0.0  # same for reloads in backward
    # Fixed bytes at step t before its node allocates its outputs and scratch: what the
    # recomputations placed just before that node see. Empty: the same as fixed_bytes.
    fixed_before_node_bytes: tuple[int, ...] = ()
    # Candidates whose value must not derive from a lossy stored form (stored lossy itself, or
    # recomputed from such a value): their backward amplifies rounding (tanh, sigmoid, softmax).
    must_be_exact: tuple[bool, ...] = ()
    # Candidates whose recomputed copy Inductor inlines into its readers (a pointwise body): it
    # holds no buffer, and its readers read what it reads, so those stay live until they run.
    # Empty: every recomputed copy is a buffer.
    fused_when_recomputed: tuple[bool, ...] = ()
    # Per candidate: -1 when its forward lifetime is a buffer whatever the plan (in fixed_bytes);
    # else the forward step creating it, where it is a buffer in the forward only when saved
    # (kept or stored): not saved, Inductor inlines it into its forward readers. Its forward
    # lifetime [that step, keep_from) is then not in fixed_bytes but held with the decision.
    # Empty: -1 for all.
    saved_only_forward_from: tuple[int, ...] = ()
    # Per candidate: the first candidate that is a result of the same multi-result op (attention's
    # output and log-sum-exp), itself for that one, -1 where none. Such results are recomputed
    # together or not at all: recomputing one re-runs the op, which makes the others too (kept
    # copies beside recomputed ones measured above the check's peak), and the op's time is
    # charged once, to the first. Empty: -1 for all.
    same_op_as: tuple[int, ...] = ()
    # Per candidate: the first candidate of its repeated-block class (itself for that one), -1
    # where none: the same value in each of several identical blocks (a transformer's layers;
    # passes/repeated_blocks.py). The greedy plan `tied` moves a class whole, so its moves follow
    # the block, not the depth; no other answer is bound by the classes. Members agree on bans
    # and store choices. Empty: -1 for all.
    same_decision_as: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        n = len(self.names)
        for name in ("nbytes", "recompute_cost_s", "can_keep", "can_recompute", "first_read",
                     "last_read", "keep_from", "recompute_from", "recompute_reads", "view_of"):
            if len(getattr(self, name)) != n:
                raise ValueError(f"ActivationProblem.{name} has {len(getattr(self, name))} entries, expected {n}")
        if self.store_choices and (len(self.store_choices) != n or len(self.created_at) != n):
            raise ValueError("ActivationProblem.store_choices and created_at need one entry per candidate")
        if self.must_be_exact and len(self.must_be_exact) != n:
            raise ValueError(f"ActivationProblem.must_be_exact has {len(self.must_be_exact)} entries, expected {n}")
        if self.saved_only_forward_from and (
                len(self.saved_only_forward_from) != n
                or any(f >= k for f, k in zip(self.saved_only_forward_from, self.keep_from))):
            raise ValueError("ActivationProblem.saved_only_forward_from needs one entry per candidate, "
                             "each before its keep_from")
        if self.same_op_as and (len(self.same_op_as) != n
                                or any(not -1 <= g <= i or (g >= 0 and self.same_op_as[g] != g)
                                       for i, g in enumerate(self.same_op_as))):
            raise ValueError("ActivationProblem.same_op_as needs one entry per candidate: -1, or the first "
                             "candidate of its group (itself for that one)")
        if self.same_decision_as and (len(self.same_decision_as) != n or any(
                not -1 <= g <= i or (g >= 0 and (self.same_decision_as[g] != g
                                                 or self.decision_shape(g) != self.decision_shape(i)))
                for i, g in enumerate(self.same_decision_as))):
            raise ValueError("ActivationProblem.same_decision_as needs one entry per candidate: -1, or the first "
                             "candidate of its class (itself for that one), whose bans and store choices it shares")
        if self.fused_when_recomputed and len(self.fused_when_recomputed) != n:
            raise ValueError(f"ActivationProblem.fused_when_recomputed has {len(self.fused_when_recomputed)} "
                             f"entries, expected {n}")
        if self.fixed_before_node_bytes and (
                len(self.fixed_before_node_bytes) != len(self.fixed_bytes)
                or any(b > f for b, f in zip(self.fixed_before_node_bytes, self.fixed_bytes))):
            raise ValueError("ActivationProblem.fixed_before_node_bytes needs one entry per step, "
                             "each <= fixed_bytes there")

    @property
    def num_steps(self) -> int:
        return len(self.fixed_bytes)

    @property
    def before_node_bytes(self) -> tuple[int, ...]:
        return self.fixed_before_node_bytes or self.fixed_bytes

    def choices_of(self, i: int) -> tuple[StoreChoice, ...]:
        return self.store_choices[i] if self.store_choices else ()

    def needed_by_backward(self, i: int) -> bool:
        return self.first_read[i] < self.num_steps

    def exact_required(self, i: int) -> bool:
        return bool(self.must_be_exact) and self.must_be_exact[i]

    def fused(self, i: int) -> bool:
        """A recomputed i is no buffer of its own: its readers compute it from its inputs."""
        return bool(self.fused_when_recomputed) and self.fused_when_recomputed[i]

    def forward_from(self, i: int) -> int:
        """First step a saved i holds bytes beyond fixed_bytes: its creation where its forward
        buffer depends on being saved, else keep_from."""
        if self.saved_only_forward_from and self.saved_only_forward_from[i] >= 0:
            return self.saved_only_forward_from[i]
        return self.keep_from[i]

    def op_group(self, i: int) -> tuple[int, ...]:
        """The candidates recomputed together with i (i alone unless a multi-result op made it)."""
        return _group_of(self.same_op_as, lambda: self._op_groups, i)

    @functools.cached_property
    def _op_groups(self) -> dict[int, tuple[int, ...]]:
        # (computed once: the greedy plan asks for every kept candidate's group at every move)
        return _members_by_first(self.same_op_as)

    def decision_shape(self, i: int) -> tuple:
        """What members of one repeated-block class must share for one decision to suit each."""
        return (self.can_keep[i], self.can_recompute[i], self.needed_by_backward(i), len(self.choices_of(i)),
                tuple(is_lossy(ch) for ch in self.choices_of(i)), self.exact_required(i))

    def decision_class(self, i: int) -> tuple[int, ...]:
        """The candidates a class move of the greedy plan changes with i (i alone where no block repeats)."""
        return _group_of(self.same_decision_as, lambda: self._decision_classes, i)

    @functools.cached_property
    def _decision_classes(self) -> dict[int, tuple[int, ...]]:
        return _members_by_first(self.same_decision_as)

    def reads_until_reader_ends(self, c: int, i: int) -> bool:
        """Whether recomputing c keeps i (which c reads) live until c's own last reader: c is a
        view of i, or c is fused into its readers (they read i in its place)."""
        return self.view_of[c] == i or self.fused(c)

    def readers(self) -> tuple[tuple[int, ...], ...]:
        """For each candidate, the candidates whose recomputation reads it."""
        return self._readers

    @functools.cached_property
    def _readers(self) -> tuple[tuple[int, ...], ...]:
        out: list[list[int]] = [[] for _ in self.names]
        for c, reads in enumerate(self.recompute_reads):
            for i in reads:
                out[i].append(c)
        return tuple(tuple(r) for r in out)


# Stored decisions: (candidate, index into its store_choices).
Stored = frozenset[tuple[int, int]]
NOTHING_STORED: Stored = frozenset()


def _group_of(first_of: tuple[int, ...], groups, i: int) -> tuple[int, ...]:
    """i's group (i alone where `first_of` names none); `groups()` is read only when it does."""
    if not first_of or first_of[i] < 0:
        return (i,)
    return groups()[first_of[i]]


def _members_by_first(first_of: tuple[int, ...]) -> dict[int, tuple[int, ...]]:
    """The members of each group named by its first member's index (-1: in none)."""
    groups: dict[int, list[int]] = {}
    for j, g in enumerate(first_of):
        if g >= 0:
            groups.setdefault(g, []).append(j)
    return {g: tuple(members) for g, members in groups.items()}


def with_fixed_bytes_at(problem: ActivationProblem, step: int, nbytes: int, *, by_node: bool = False
                        ) -> ActivationProblem:
    """`problem` with `nbytes` more held at `step` by something no decision changes (eager code
    run between the forward and the backward: the step the backward starts); `by_node`: held by
    the step's node while it runs (a larger working set of its own: a loss head in fewer chunks),
    not before it allocates."""
    if not nbytes or not 0 <= step < len(problem.fixed_bytes):
        return problem
    fixed = list(problem.fixed_bytes)
    fixed[step] += nbytes
    before = list(problem.before_node_bytes if by_node else problem.fixed_before_node_bytes)
    if before and not by_node:
        before[step] += nbytes
    return dataclasses.replace(problem, fixed_bytes=tuple(fixed), fixed_before_node_bytes=tuple(before))


def is_lossy(choice: StoreChoice) -> bool:
    return choice.kind == Choice.QUANTIZE


def lossy_values(problem: ActivationProblem, recompute: frozenset[int], stored: Stored) -> set[int]:
    """Candidates whose backward value is inexact: stored in a lossy form, or recomputed from
    such a value (recomputations read the converted-back copy)."""
    lossy = {i for i, k in stored if is_lossy(problem.choices_of(i)[k])}
    for c in sorted(recompute):  # topological order: what c reads is settled before c
        if any(j in lossy for j in problem.recompute_reads[c]):
            lossy.add(c)
    return lossy


@dataclass(frozen=True)
class ActivationSolution:
    keep: frozenset[int]
    recompute: frozenset[int]
    stored: Stored
    model_peak_bytes: int  # peak under the model with the tightest placement
    added_time_s: float
    status: str  # memcompile.plan.status_text: FITS, OPTIMAL, FEASIBLE, FALLBACK, INFEASIBLE or LEAST_PEAK
    lower_bound_s: float
    solve_s: float

    @property
    def gap(self) -> float:
        if self.added_time_s <= 0:
            return 0.0
        return max(0.0, (self.added_time_s - self.lower_bound_s) / self.added_time_s)

    @property
    def decisions(self) -> tuple[frozenset[int], frozenset[int], Stored]:
        return self.keep, self.recompute, self.stored


def placement(problem: ActivationProblem, recompute: frozenset[int]) -> tuple[list[int], list[int]]:
    """Tightest (start, end) step of every candidate given what is recomputed: a recomputed (or
    dequantized, or reloaded) tensor is materialised just before its first reader (direct, or a
    recomputed candidate reading it) and ends at its last one. Defined for all candidates so it
    can seed the solver too."""
    readers = problem.readers()
    last = problem.num_steps - 1
    start = [0] * len(problem.names)
    end = [0] * len(problem.names)
    for i in reversed(range(len(problem.names))):  # readers come after what they read
        s, e = problem.first_read[i], problem.last_read[i]
        for c in readers[i]:
            if c in recompute:
                s = min(s, start[c])
                e = max(e, end[c] if problem.reads_until_reader_ends(c, i) else start[c])
        start[i] = min(max(s, problem.recompute_from[i]), last)
        end[i] = min(e, last)
    return start, end


def reload_step(problem: ActivationProblem, i: int, choice: StoreChoice, start: int) -> int:
    """The step whose node an offloaded tensor's reload is issued before (prefetch)."""
    return max(problem.recompute_from[i], start - choice.prefetch_steps)


def step_loads(
    problem: ActivationProblem, keep: frozenset[int], recompute: frozenset[int], stored: Stored = NOTHING_STORED,
    placed: tuple[list[int], list[int]] | None = None,
) -> list[int]:
    """Modelled peak bytes at every step, on the same fine time grid as the CP-SAT model.

    Recomputed tensors that start at step t run, in topological order, just before t's node (as
    the rewrite places them): slot t*S + i for candidate i, the node at slot t*S + S - 1. A tensor
    is live from its (re)computation or the end of its forward life to its last reader's slot,
    so a chain's members are live one after another. Dequantization and reloads materialise at
    the same slot as a recomputation would (a reload at its prefetch step). `placed` is
    `placement(problem, recompute)` when the caller has it already.
    """
    start, _ = placed or placement(problem, recompute)
    ends = fine_ends(problem, recompute, start)
    horizon, scale = problem.num_steps, len(problem.names) + 1
    diff: dict[int, int] = {}

    def add(nbytes: int, a: int, b: int) -> None:
        if nbytes and a <= b:
            diff[a] = diff.get(a, 0) + nbytes
            diff[b + 1] = diff.get(b + 1, 0) - nbytes

    for i in keep:
        if problem.keep_from[i] < horizon:
            add(problem.nbytes[i], _hold_slot(problem, i, scale), ends[i])
    for i in recompute:
        # (A fused copy holds no buffer; a recompute_from past the horizon means its forward
        # lifetime covers the whole step.)
        if problem.recompute_from[i] < horizon and not problem.fused(i):
            add(problem.nbytes[i], start[i] * scale + i, ends[i])
    for i, k in stored:
        choice = problem.choices_of(i)[k]
        add(problem.nbytes[i], _hold_slot(problem, i, scale), problem.keep_from[i] * scale - 1)  # forward buffer
        materialised = start[i] * scale + i
        if choice.kind == Choice.QUANTIZE:
            created = problem.created_at[i] * scale + scale - 1
            add(choice.stored_bytes, created, materialised)
            add(choice.store_transient_bytes, created, created)
            add(choice.load_transient_bytes, materialised, materialised)
        else:
            add(problem.nbytes[i], problem.keep_from[i] * scale, choice.release_step * scale + scale - 1)
            materialised = reload_step(problem, i, choice, start[i]) * scale + i
        add(problem.nbytes[i], materialised, ends[i])
    slots = sorted(diff)
    before_node = problem.before_node_bytes
    loads, running, k = [], 0, 0
    for t in range(horizon):
        node_slot = t * scale + scale - 1
        while k < len(slots) and slots[k] <= t * scale:
            running += diff[slots[k]]
            k += 1
        # Slots before the node see the fixed bytes without the node's own allocations.
        most_before = running if t * scale < node_slot else None
        while k < len(slots) and slots[k] < node_slot:
            running += diff[slots[k]]
            most_before = running if most_before is None else max(most_before, running)
            k += 1
        while k < len(slots) and slots[k] <= node_slot:
            running += diff[slots[k]]
            k += 1
        at_node = problem.fixed_bytes[t] + running
        loads.append(at_node if most_before is None else max(at_node, before_node[t] + most_before))
    return loads


def _hold_slot(problem: ActivationProblem, i: int, scale: int) -> int:
    """Fine slot from which a saved i holds bytes the fixed bytes do not count: its creation's
    node slot where its forward buffer depends on being saved, else the start of keep_from."""
    f = problem.forward_from(i)
    return f * scale + scale - 1 if f < problem.keep_from[i] else problem.keep_from[i] * scale


def added_time_s(problem: ActivationProblem, recompute: frozenset[int], stored: Stored = NOTHING_STORED) -> float:
    """Recomputation, conversion kernels, exposed transfers; transfers beyond what the compute of
    a phase can hide are paid in full (one host link shared by every offload)."""
    link = sum(problem.choices_of(i)[k].link_s for i, k in stored)
    exposed = max(0.0, link - problem.forward_compute_s) + max(0.0, link - problem.backward_compute_s)
    return (sum(problem.recompute_cost_s[i] for i in recompute)
            + sum(problem.choices_of(i)[k].time_cost_s for i, k in stored) + exposed)


def evaluate(problem: ActivationProblem, keep: frozenset[int], recompute: frozenset[int],
             stored: Stored = NOTHING_STORED) -> tuple[int, float]:
    """(modelled peak bytes, added time) of a decision set."""
    loads = step_loads(problem, keep, recompute, stored)
    return max(loads, default=0), added_time_s(problem, recompute, stored)


def is_consistent(problem: ActivationProblem, keep: frozenset[int], recompute: frozenset[int],
                  stored: Stored = NOTHING_STORED) -> bool:
    """Every needed candidate is kept, recomputed or stored, once, only where allowed, nothing extra."""
    stored_ids = [i for i, _ in stored]
    held = set(keep) | set(stored_ids)
    if keep & recompute or len(stored_ids) != len(set(stored_ids)) or held & recompute or keep & set(stored_ids):
        return False
    if any(not (0 <= k < len(problem.choices_of(i))) for i, k in stored):
        return False
    needed = {i for i in range(len(problem.names)) if problem.needed_by_backward(i)}
    for c in recompute:
        needed.update(problem.recompute_reads[c])
    split = any(any(j not in recompute for j in problem.op_group(i)) for i in recompute)
    return (
        needed == held | set(recompute)
        and not split
        and all(problem.can_keep[i] for i in keep)
        and all(problem.can_recompute[i] for i in recompute)
        and not any(problem.exact_required(i) for i in lossy_values(problem, recompute, stored))
    )


def close_decisions(
    problem: ActivationProblem, prefer_recompute: set[int], prefer_store: dict[int, int] | None = None,
) -> tuple[frozenset[int], frozenset[int], Stored]:
    """Complete a preference into a consistent plan: needed candidates in `prefer_recompute` (or
    that cannot be kept) are recomputed, those in `prefer_store` stored with that choice, the
    rest kept. Walks readers before what they read."""
    prefer_store = prefer_store or {}
    prefer = set(prefer_recompute)
    for _ in range(len(problem.names) + 1):  # results of one op go together (ActivationProblem.same_op_as)
        decisions = _close_once(problem, prefer, prefer_store)
        split = {j for i in decisions[1] for j in problem.op_group(i)} - decisions[1]
        if not split or split <= prefer:
            return decisions
        prefer |= split
    return decisions


def _close_once(problem: ActivationProblem, prefer_recompute: set[int], prefer_store: dict[int, int],
                ) -> tuple[frozenset[int], frozenset[int], Stored]:
    needed = {i for i in range(len(problem.names)) if problem.needed_by_backward(i)}
    keep: set[int] = set()
    recompute: set[int] = set()
    stored: set[tuple[int, int]] = set()
    exact: set[int] = set()  # what a must-be-exact recomputation reads (readers come first)
    for i in reversed(range(len(problem.names))):
        if i not in needed:
            continue
        if (i in prefer_recompute or not problem.can_keep[i]) and problem.can_recompute[i]:
            recompute.add(i)
            needed.update(problem.recompute_reads[i])
            if i in exact or problem.exact_required(i):
                exact.update(problem.recompute_reads[i])
        elif (i in prefer_store and problem.can_keep[i]
              and not (is_lossy(problem.choices_of(i)[prefer_store[i]]) and (i in exact or problem.exact_required(i)))):
            stored.add((i, prefer_store[i]))
        else:
            keep.add(i)
    return frozenset(keep), frozenset(recompute), frozenset(stored)


def exact_needed(problem: ActivationProblem, recompute: set[int] | frozenset[int]) -> set[int]:
    """Candidates that a must-be-exact candidate is (transitively) recomputed from: they may not
    be stored in a lossy form."""
    exact: set[int] = set()
    for c in sorted(recompute, reverse=True):  # readers before what they read
        if c in exact or problem.exact_required(c):
            exact.update(problem.recompute_reads[c])
    return exact


def _bytes_freed_at(problem, i: int, move: tuple[str, int], t: int, start: list[int], end: list[int]) -> int:
    """Bytes that changing kept candidate i to `move` frees at step t (0 if it frees none there)."""
    kind, k = move
    if kind == Choice.RECOMPUTE and problem.forward_from(i) <= t < problem.keep_from[i]:
        return problem.nbytes[i]  # its forward buffer, which only saving it makes
    if not problem.keep_from[i] <= t <= end[i]:
        return 0
    if kind == Choice.RECOMPUTE:
        return problem.nbytes[i] if t < start[i] or problem.fused(i) else 0
    choice = problem.choices_of(i)[k]
    if choice.kind == Choice.QUANTIZE:
        return problem.nbytes[i] - choice.stored_bytes if t < start[i] else 0
    return problem.nbytes[i] if choice.release_step < t < reload_step(problem, i, choice, start[i]) else 0


def greedy_plan(
    problem: ActivationProblem, budget_bytes: int,
    start_from: tuple[frozenset[int], frozenset[int], Stored] | None = None, store_only: bool = False,
    per_second: bool = True, tied: bool = False,
) -> tuple[frozenset[int], frozenset[int], Stored]:
    """Start from keeping everything (or from `start_from`); while the peak is over budget, change
    the kept tensor live at the peak step that frees the most bytes there per second of added
    time (or the most bytes, without `per_second`): recompute it, unless `store_only`, or store
    it as one of its store choices. `tied`: a move changes the kept members of a repeated-block
    class together (ActivationProblem.same_decision_as). Always a consistent plan; returns the
    first under budget, else the one with the least peak seen."""
    prefer: set[int] = set(start_from[1]) if start_from else set()
    prefer_store: dict[int, int] = dict(start_from[2]) if start_from else {}
    plan = close_decisions(problem, prefer, prefer_store)
    best_plan, best_peak = plan, None
    group_cost = [sum(problem.recompute_cost_s[j] for j in problem.op_group(i)) for i in range(len(problem.names))]
    for _ in range(2 * len(problem.names) + 1):
        placed = placement(problem, plan[1])
        loads = step_loads(problem, *plan, placed=placed)
        t = max(range(len(loads)), key=loads.__getitem__)
        peak = loads[t]
        if best_peak is None or peak < best_peak:
            best_plan, best_peak = plan, peak
        if peak <= budget_bytes:
            return plan
        start, end = placed
        exact = exact_needed(problem, plan[1])
        moves = []
        seen: set[int] = set()
        for i in plan[0]:
            if i in prefer or problem.nbytes[i] == 0:
                continue
            movers = tuple(j for j in problem.decision_class(i) if j in plan[0] and j not in prefer) if tied else (i,)
            if movers[0] in seen:
                continue
            seen.add(movers[0])
            options = [("store", k) for k, choice in enumerate(problem.choices_of(i))
                       if not (is_lossy(choice) and any(j in exact or problem.exact_required(j) for j in movers))]
            if problem.can_recompute[i] and not store_only:
                options.append((Choice.RECOMPUTE, -1))
            for move in options:
                freed = sum(_bytes_freed_at(problem, j, move, t, start, end) for j in movers)
                cost = sum(group_cost[j] if move[0] == Choice.RECOMPUTE
                           else problem.choices_of(j)[move[1]].time_cost_s + problem.choices_of(j)[move[1]].link_s
                           for j in movers)
                if freed > 0:
                    moves.append((freed / (cost + 1e-9) if per_second else freed, -movers[0], move, movers))
        if not moves:
            break
        _, _, move, picked = max(moves)
        for pick in picked:
            if move[0] == Choice.RECOMPUTE:
                prefer.add(pick)
                prefer_store.pop(pick, None)
            else:
                prefer_store[pick] = move[1]
        plan = close_decisions(problem, prefer, prefer_store)
    return best_plan


def _fixed_segments(problem: ActivationProblem, scale: int) -> list[tuple[int, int, int]]:
    """Maximal runs of equal fixed bytes on the fine grid: (first slot, last slot, bytes). In step
    t, the slots before the node's own (t*S + S - 1) hold the before-node bytes."""
    runs: list[tuple[int, int, int]] = []

    def extend(a: int, b: int, nbytes: int) -> None:
        if runs and runs[-1][2] == nbytes and runs[-1][1] == a - 1:
            runs[-1] = (runs[-1][0], b, nbytes)
        else:
            runs.append((a, b, nbytes))

    for t, (before, at_node) in enumerate(zip(problem.before_node_bytes, problem.fixed_bytes)):
        if scale > 1:
            extend(t * scale, t * scale + scale - 2, before)
        extend(t * scale + scale - 1, t * scale + scale - 1, at_node)
    return runs


def fine_ends(problem: ActivationProblem, recompute: frozenset[int], start: list[int]) -> list[int]:
    """End of each candidate's live span on the solver's fine time grid (see `_build_model`)."""
    scale = len(problem.names) + 1
    readers = problem.readers()
    ends = [-1] * len(problem.names)
    for i in reversed(range(len(problem.names))):
        e = problem.last_read[i] * scale + scale - 1 if problem.last_read[i] >= 0 else -1
        for c in readers[i]:
            if c in recompute:
                e = max(e, ends[c] if problem.reads_until_reader_ends(c, i) else start[c] * scale + c)
        ends[i] = e
    return ends


@dataclass
class _Model:
    model: cp_model.CpModel
    keep: list
    recompute: list
    store: list  # per candidate, one bool per store choice
    start: list
    end: list


def _build_model(problem: ActivationProblem, budget_bytes: int | None) -> _Model:
    """CP-SAT model; with budget None the capacity is a variable to minimise.

    Time is fine-grained so the model matches `step_loads`: step t spans slots
    [t*S, t*S + S) with S = candidates + 1; a candidate i recomputed for step t runs at slot
    t*S + i (candidates are in topological order, so a chain runs in order) and the step's own
    node at slot t*S + S - 1.
    """
    model = cp_model.CpModel()
    n, horizon = len(problem.names), problem.num_steps
    last = horizon - 1
    scale = n + 1
    keep = [model.new_bool_var(f"keep_{i}") for i in range(n)]
    recompute = [model.new_bool_var(f"recompute_{i}") for i in range(n)]
    store = [[model.new_bool_var(f"store_{i}_{k}") for k in range(len(problem.choices_of(i)))] for i in range(n)]
    start = [model.new_int_var(0, last, f"start_{i}") for i in range(n)]  # step of materialisation
    end = [model.new_int_var(-1, horizon * scale, f"end_{i}") for i in range(n)]  # fine slot
    readers = problem.readers()
    intervals, demands = [], []
    for i in range(n):
        held = [keep[i]] + store[i]
        if not problem.can_keep[i]:
            model.add(sum(held) == 0)
        if not problem.can_recompute[i]:
            model.add(recompute[i] == 0)
        if problem.same_op_as and 0 <= problem.same_op_as[i] != i:
            model.add(recompute[i] == recompute[problem.same_op_as[i]])
        if problem.needed_by_backward(i):
            model.add(sum(held) + recompute[i] == 1)
        else:
            model.add(sum(held) + recompute[i] <= sum(recompute[c] for c in readers[i]))
            for c in readers[i]:
                model.add(sum(held) + recompute[i] >= recompute[c])
        # The rewrite materialises a value just before its first reader: start is exactly
        # max(recompute_from, min(first direct read, starts of recomputed readers)), as `placement`.
        first_need: list[int | cp_model.IntVar] = [min(problem.first_read[i], horizon)]
        for c in readers[i]:
            need_c = model.new_int_var(0, horizon, f"need_{i}_{c}")
            model.add(need_c == start[c]).only_enforce_if(recompute[c])
            model.add(need_c == horizon).only_enforce_if(recompute[c].negated())
            first_need.append(need_c)
        earliest = model.new_int_var(0, horizon, f"earliest_{i}")
        model.add_min_equality(earliest, first_need)
        placed = model.new_int_var(0, horizon, f"placed_{i}")
        model.add_max_equality(placed, [earliest, min(problem.recompute_from[i], horizon)])
        model.add_min_equality(start[i], [placed, last])
        if problem.last_read[i] >= 0:
            model.add(end[i] >= problem.last_read[i] * scale + scale - 1)
        for c in readers[i]:
            reach = end[c] if problem.reads_until_reader_ends(c, i) else start[c] * scale + c
            model.add(end[i] >= reach).only_enforce_if(recompute[c])
        if problem.nbytes[i] == 0:
            continue
        size_cap = horizon * scale
        if problem.keep_from[i] <= last:
            first_slot = _hold_slot(problem, i, scale)
            model.add(end[i] >= first_slot - 1).only_enforce_if(keep[i])
            size = model.new_int_var(0, size_cap, f"keep_size_{i}")
            intervals.append(model.new_optional_interval_var(first_slot, size, end[i] + 1, keep[i], f"keep_iv_{i}"))
            demands.append(problem.nbytes[i])
        if problem.recompute_from[i] <= last:
            # Recomputed or dequantized: the full tensor from its materialisation slot on.
            # (A fused recomputation is no buffer: only a dequantized copy is.)
            materialised = ([] if problem.fused(i) else [recompute[i]]) + [
                store[i][k] for k, ch in enumerate(problem.choices_of(i)) if ch.kind == Choice.QUANTIZE]
            present = materialised[0] if materialised else None
            if len(materialised) > 1:
                present = model.new_bool_var(f"materialised_{i}")
                model.add(present == sum(materialised))
            if present is not None:
                size = model.new_int_var(0, size_cap, f"recompute_size_{i}")
                intervals.append(model.new_optional_interval_var(start[i] * scale + i, size, end[i] + 1, present,
                                                              f"recompute_iv_{i}"))
                demands.append(problem.nbytes[i])
        forward_slot = _hold_slot(problem, i, scale)
        for k, choice in enumerate(problem.choices_of(i)):
            if forward_slot < problem.keep_from[i] * scale:  # its forward buffer, made by saving it
                intervals.append(model.new_optional_fixed_size_interval_var(
                    forward_slot, problem.keep_from[i] * scale - forward_slot, store[i][k], f"forward_iv_{i}_{k}"))
                demands.append(problem.nbytes[i])
            if choice.kind == Choice.QUANTIZE:
                first_slot = problem.created_at[i] * scale + scale - 1
                size = model.new_int_var(0, size_cap, f"held_size_{i}_{k}")
                intervals.append(model.new_optional_interval_var(first_slot, size, start[i] * scale + i + 1,
                                                              store[i][k], f"held_iv_{i}_{k}"))
                demands.append(choice.stored_bytes)
                if choice.store_transient_bytes:
                    intervals.append(model.new_optional_fixed_size_interval_var(first_slot, 1, store[i][k],
                                                                           f"store_scratch_{i}_{k}"))
                    demands.append(choice.store_transient_bytes)
                if choice.load_transient_bytes:
                    intervals.append(model.new_optional_fixed_size_interval_var(start[i] * scale + i, 1, store[i][k],
                                                                           f"load_scratch_{i}_{k}"))
                    demands.append(choice.load_transient_bytes)
                continue
            a, b = problem.keep_from[i] * scale, choice.release_step * scale + scale - 1
            if a <= b:
                intervals.append(model.new_optional_interval_var(a, b - a + 1, b + 1, store[i][k], f"copyout_iv_{i}_{k}"))
                demands.append(problem.nbytes[i])
            reload = model.new_int_var(0, horizon, f"reload_{i}_{k}")
            ahead = model.new_int_var(-horizon, horizon, f"ahead_{i}_{k}")
            model.add(ahead == start[i] - choice.prefetch_steps)
            model.add_max_equality(reload, [ahead, min(problem.recompute_from[i], horizon)])
            size = model.new_int_var(0, size_cap, f"reload_size_{i}_{k}")
            intervals.append(model.new_optional_interval_var(reload * scale + i, size, end[i] + 1, store[i][k],
                                                          f"reload_iv_{i}_{k}"))
            demands.append(problem.nbytes[i])
    _add_exactness(model, problem, recompute, store)
    for a, b, fixed in _fixed_segments(problem, scale):
        if fixed:
            intervals.append(model.new_interval_var(a, b - a + 1, b + 1, f"fixed_{a}"))
            demands.append(fixed)
    capacity: cp_model.IntVar | int
    if budget_bytes is None:
        capacity = model.new_int_var(0, sum(problem.nbytes) + max(problem.fixed_bytes, default=0), "peak")
        model.minimize(capacity)
    else:
        capacity = budget_bytes
        model.minimize(_time_objective(model, problem, recompute, store))
    model.add_cumulative(intervals, demands, capacity)
    return _Model(model, keep, recompute, store, start, end)


def _add_exactness(model: cp_model.CpModel, problem: ActivationProblem, recompute: list, store: list) -> None:
    """lossy_i >= q_ik for lossy choices k; lossy_c >= lossy_j + r_c - 1 for j read by c's
    recomputation; lossy_c = 0 where c must be exact (lower bounds suffice: nothing rewards
    lossy_i = 1)."""
    if not problem.must_be_exact or not any(problem.must_be_exact):
        return
    lossy: dict[int, cp_model.IntVar] = {}
    for i in range(len(problem.names)):
        sources = [store[i][k] for k, ch in enumerate(problem.choices_of(i)) if is_lossy(ch)]
        inherited = [lossy[j] for j in problem.recompute_reads[i] if j in lossy] if problem.can_recompute[i] else []
        if not sources and not inherited:
            continue
        var = model.new_bool_var(f"lossy_{i}")
        for q in sources:
            model.add(var >= q)
        for parent in inherited:
            model.add(var >= parent + recompute[i] - 1)
        if problem.must_be_exact[i]:
            model.add(var == 0)
        lossy[i] = var


def _units(seconds: float) -> int:
    return int(round(seconds / _TIME_UNIT_S))


def _time_objective(model: cp_model.CpModel, problem: ActivationProblem, recompute: list, store: list):
    """Added time in CP-SAT units; mirrors `added_time_s` (+1 per non-keep choice breaks ties to keeping)."""
    terms = [(_units(problem.recompute_cost_s[i]) + 1) * recompute[i] for i in range(len(recompute))]
    link_terms = []
    for i, bools in enumerate(store):
        for k, var in enumerate(bools):
            choice = problem.choices_of(i)[k]
            terms.append((_units(choice.time_cost_s) + 1) * var)
            if choice.link_s > 0:
                link_terms.append(_units(choice.link_s) * var)
    if link_terms:
        # Exposed transfer time: what the phase's compute cannot hide, in each direction.
        total_link = sum(link_terms)
        cap = sum(_units(problem.choices_of(i)[k].link_s) for i, b in enumerate(store) for k in range(len(b)))
        for phase, compute_s in (("forward", problem.forward_compute_s), ("backward", problem.backward_compute_s)):
            exposed = model.new_int_var(0, cap, f"exposed_{phase}")
            model.add(exposed >= total_link - _units(compute_s))
            terms.append(exposed)
    return sum(terms)


def _decisions_from(outcome, built: _Model) -> tuple[frozenset[int], frozenset[int], Stored]:
    value = outcome.solver.Value
    return (frozenset(i for i, v in enumerate(built.keep) if value(v)),
            frozenset(i for i, v in enumerate(built.recompute) if value(v)),
            frozenset((i, k) for i, bools in enumerate(built.store) for k, v in enumerate(bools) if value(v)))


def _add_hint(problem: ActivationProblem, built: _Model, hint) -> None:
    keep, recompute, stored = hint
    hint_start, _ = placement(problem, recompute)
    hint_end = fine_ends(problem, recompute, hint_start)
    for i in range(len(problem.names)):
        built.model.add_hint(built.keep[i], i in keep)
        built.model.add_hint(built.recompute[i], i in recompute)
        for k, var in enumerate(built.store[i]):
            built.model.add_hint(var, (i, k) in stored)
        built.model.add_hint(built.start[i], hint_start[i])
        built.model.add_hint(built.end[i], hint_end[i])


# CP-SAT searches for the fastest plan only on graphs of at most this many candidates. On a
# 24-layer Llama (2,594-2,616 candidates) it ran to its 30 s limit: once without a plan better
# than the greedy one, once to 545.24 ms added where the greedy plan kept back reached 542.59 ms
# in 15 s; on the chunked graph the greedy plan kept back added 124.60 ms (the greedy plan
# 137.28). On small graphs it proves the optimum.
SEARCH_MAX_CANDIDATES = 1500
# The status detail of a graph too large to search: its plan is the greedy one, kept back.
NOT_SEARCHED = f"graphs of more than {SEARCH_MAX_CANDIDATES} candidates are not searched"
# Share of the time limit that keeping back recomputations (`kept_back`) may take.
KEEP_BACK_SHARE = 0.25


def kept_back(problem: ActivationProblem, plan: tuple[frozenset[int], frozenset[int], Stored], budget_bytes: int,
              time_limit_s: float) -> tuple[frozenset[int], frozenset[int], Stored]:
    """`plan` with recomputations taken back where the modelled peak stays within the budget,
    the most expensive per byte first, each change kept only where it saves time. The greedy
    plan overshoots: at each move it recomputes what frees most per second at the peak of the
    moment, and moves made early may not be needed once later ones are (a 24-layer Llama:
    137.28 -> 124.60 ms added, 502 changes tried in 4.6 s). Stops after `time_limit_s`."""
    began = time.perf_counter()
    added = added_time_s(problem, plan[1], plan[2])
    order = sorted((i for i in plan[1] if problem.can_keep[i] and problem.recompute_cost_s[i] > 0),
                   key=lambda i: (-problem.recompute_cost_s[i] / max(1, problem.nbytes[i]), i))
    for i in order:
        if time.perf_counter() - began > time_limit_s:
            break
        if i not in plan[1]:
            continue
        trial = close_decisions(problem, set(plan[1]) - set(problem.op_group(i)), dict(plan[2]))
        peak, trial_added = evaluate(problem, *trial)
        if peak <= budget_bytes and trial_added < added:
            plan, added = trial, trial_added
    return plan


def solve_activation_plan(
    problem: ActivationProblem, budget_bytes: int, *, time_limit_s: float = 10.0, workers: int = 2, seed: int = 0,
) -> ActivationSolution:
    """Least added time with modelled peak <= budget; status INFEASIBLE when none exists.

    The greedy plan (and, where blocks repeat, the greedy plan that moves a class whole), the
    faster that fits with recomputations kept back; then, on graphs of at most
    SEARCH_MAX_CANDIDATES, CP-SAT hinted with it."""
    began = time.perf_counter()
    if problem.fixed_bytes and max(problem.fixed_bytes) > budget_bytes:
        return ActivationSolution(frozenset(), frozenset(), NOTHING_STORED, max(problem.fixed_bytes), 0.0,
                                  StatusKind.INFEASIBLE, 0.0, 0.0)
    greedy = greedy_plan(problem, budget_bytes)
    greedy_peak, greedy_added = evaluate(problem, *greedy)
    plans = [greedy] + ([greedy_plan(problem, budget_bytes, tied=True)] if problem.same_decision_as else [])
    fitting = [p for p in plans if evaluate(problem, *p)[0] <= budget_bytes]
    best = None
    if fitting:
        best = kept_back(problem, min(fitting, key=lambda p: added_time_s(problem, p[1], p[2])), budget_bytes,
                         KEEP_BACK_SHARE * time_limit_s)
    best_status, lower_s = StatusKind.FALLBACK, 0.0
    target = budget_bytes
    # CP-SAT may spread a recompute chain over earlier steps, which `evaluate` (the rewrite's
    # placement) does not: accept its answer only when `evaluate` agrees, else ask for less.
    while len(problem.names) <= SEARCH_MAX_CANDIDATES and time.perf_counter() - began < 0.9 * time_limit_s:
        built = _build_model(problem, target)
        _add_hint(problem, built, best or greedy)
        remaining = time_limit_s - (time.perf_counter() - began)
        outcome = run_model(built.model, time_limit_s=remaining, workers=workers, seed=seed)
        if not outcome.has_solution:
            if outcome.status == "infeasible" and target == budget_bytes and best is None:
                return ActivationSolution(*greedy, greedy_peak, greedy_added, StatusKind.INFEASIBLE, 0.0,
                                          time.perf_counter() - began)
            break
        chosen = _decisions_from(outcome, built)
        peak, added = evaluate(problem, *chosen)
        if peak <= budget_bytes:
            proven = outcome.status == "optimal" and target == budget_bytes
            if not proven:
                chosen = kept_back(problem, chosen, budget_bytes, KEEP_BACK_SHARE * time_limit_s)
                added = added_time_s(problem, chosen[1], chosen[2])
            if best is None or added <= evaluate(problem, *best)[1]:
                best = chosen
            # The plan kept is no slower than CP-SAT's, so its proof covers it too (a greedy
            # plan that ties CP-SAT's optimum within the 10 ns time unit was called "fallback").
            best_status = StatusKind.OPTIMAL if proven else StatusKind.FEASIBLE
            lower_s = added if proven else max(0.0, outcome.lower_bound) * _TIME_UNIT_S
            break
        target -= peak - budget_bytes
    if best is None:
        return ActivationSolution(*greedy, greedy_peak, greedy_added, StatusKind.INFEASIBLE, 0.0, time.perf_counter() - began)
    peak, added = evaluate(problem, *best)
    status = (status_text(best_status, NOT_SEARCHED) if len(problem.names) > SEARCH_MAX_CANDIDATES
              else str(best_status))
    return ActivationSolution(*best, peak, added, status, min(lower_s, added), time.perf_counter() - began)


def recomputed_further(problem: ActivationProblem, start: tuple[frozenset[int], frozenset[int], Stored],
                       budget_bytes: int, time_limit_s: float) -> tuple[frozenset[int], frozenset[int], Stored] | None:
    """A plan within `budget_bytes` from `start` (a plan of a problem alike but for fixed bytes):
    the greedy plan's moves from it, then recomputations kept back; None where the moves find none.
    As fast as the few moves it needs, where solving again from keeping everything takes the
    whole greedy plan (a 24-layer Llama: 5.5 s)."""
    plan = greedy_plan(problem, budget_bytes, start_from=start)
    if evaluate(problem, *plan)[0] > budget_bytes:
        return None
    return kept_back(problem, plan, budget_bytes, time_limit_s)


MIN_PEAK_WALL_FACTOR = 10

# CP-SAT searches for a lower peak than the heuristic plans only on graphs of at most
# SEARCH_MAX_CANDIDATES. On a 24-layer Llama (2,616 candidates) each deterministic unit cost
# 80-200 s of wall time (its cumulative propagation is not counted in that time) and lowered the
# greedy plan's peak by 209 B of 875 MB; on small graphs it finds peaks the heuristics miss.
# A heuristic plan within this share of `peak_lower_bound` is not searched beyond: no plan can
# save more (GPT style file, 24 layers: the greedy plan 1 KiB above the bound, which CP-SAT then
# took 22 s to prove).
MIN_PEAK_BOUND_SLACK = 1e-3


def peak_lower_bound(problem: ActivationProblem) -> int:
    """Bytes every plan holds at some step: the fixed bytes, plus each value the backward reads
    between its first direct read and its last read (kept, recomputed, reloaded or dequantized,
    it is a buffer there), except copies that recomputing would inline into their readers."""
    horizon = problem.num_steps
    change = [0] * (horizon + 1)
    for i in range(len(problem.names)):
        if problem.nbytes[i] == 0 or problem.fused(i) or not problem.needed_by_backward(i):
            continue
        if max(problem.keep_from[i], problem.recompute_from[i]) >= horizon:
            continue  # its forward lifetime covers the step: in the fixed bytes
        # before keep_from its forward lifetime is in the fixed bytes
        first, last = max(problem.first_read[i], problem.keep_from[i]), min(problem.last_read[i], horizon - 1)
        if first <= last:
            change[first] += problem.nbytes[i]
            change[last + 1] -= problem.nbytes[i]
    bound, running = 0, 0
    for t in range(horizon):
        running += change[t]
        bound = max(bound, problem.fixed_bytes[t] + running)
    return bound


def solve_min_peak(problem: ActivationProblem, *, time_limit_s: float = 10.0, workers: int = 2,
                   seed: int = 0) -> ActivationSolution:
    """The decisions with the least modelled peak: the smallest budget this model can meet.

    The best of the heuristic plans (recompute all it can, greedy per second and per byte), then,
    where that is not within MIN_PEAK_BOUND_SLACK of `peak_lower_bound` and the graph is small
    enough for it, CP-SAT's own search, kept where it finds a lower peak."""
    began = time.perf_counter()
    frugal = close_decisions(problem, prefer_recompute=set(range(len(problem.names))))
    heuristic = [frugal, greedy_plan(problem, 0)]
    if problem.same_decision_as:
        # Moving classes whole reaches peaks as low or lower in a time that follows the block
        # (24-layer Llama, traced: 852.56 MB in 0.5 s per byte, where single moves reached 886.11
        # MB in 8.6 s per second and stalled at 1,110.45 MB per byte; chunked: 816.02 MB both, but
        # single moves per second at 281 ms added, class moves at 432): the single-move plan per
        # second stays for its time at an equal peak, per byte only on small graphs.
        heuristic += [greedy_plan(problem, 0, tied=True), greedy_plan(problem, 0, per_second=False, tied=True)]
    if not problem.same_decision_as or len(problem.names) <= SEARCH_MAX_CANDIDATES:
        heuristic.append(greedy_plan(problem, 0, per_second=False))
    start = min(heuristic, key=lambda d: evaluate(problem, *d))
    best, (peak, added) = start, evaluate(problem, *start)
    found_by: str = StatusKind.FALLBACK  # (the status speaks of the peak, not of time)
    if peak > peak_lower_bound(problem) * (1 + MIN_PEAK_BOUND_SLACK) and len(problem.names) <= SEARCH_MAX_CANDIDATES:
        built = _build_model(problem, None)
        # One worker and a deterministic-time limit: the smallest budget we report must be the
        # one a later compile at exactly that budget finds again. The wall-clock limit is only a
        # guard, set wide: where it stops the search first (a loaded machine), the plan depends
        # on the load. Not hinted with the heuristic plan: so hinted, the convbn stack's floor
        # (tests/test_inductor_e2e.py) was one a compile at it refused by 16 B.
        searched = run_model(built.model, time_limit_s=MIN_PEAK_WALL_FACTOR * time_limit_s, workers=1, seed=seed,
                             extra_params={"max_deterministic_time": time_limit_s})
        if searched.has_solution:
            found = _decisions_from(searched, built)
            scored = evaluate(problem, *found)
            if scored < (peak, added):
                best, (peak, added), found_by = found, scored, searched.status
    status = status_text(StatusKind.LEAST_PEAK, found_by)
    return ActivationSolution(*best, peak, added, status, 0.0, time.perf_counter() - began)
