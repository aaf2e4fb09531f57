"""Which tensors Inductor materializes as buffers, predicted from plain facts about each op.

Inductor lowers most pointwise ops to loop bodies that are not stored: a consumer inlines the body
and reads the producer's inputs itself (torch/_inductor/ir.py `Pointwise`, `StorageBox`). A body
becomes a buffer ("realized") only when something forces it. The rules below restate what
torch 2.13 does (`torch/_inductor/graph.py` `run_node`, `ir.py` `StorageBox.mark_reuse /
should_realize_on_reuse / has_exceeded_max_reads`, `lowering.py` `make_reduction`,
`needs_realized_inputs`, fallback kernels):

- graph inputs, graph outputs (and bases of outputs that are views), fallback / extern kernel
  outputs (mm, addmm, bmm, convolution, attention, ops without a lowering) are buffers;
- inputs of extern kernels and of ops in `needs_realized_inputs` are realized;
- reductions are realized (`make_reduction`), unless tiny enough to be unrolled;
- a pointwise body with more than one user is realized when it contains a heavy op on CPU
  (exp, log, log10, log1p, log2, sigmoid, tanh), when its op count exceeds the opcount threshold
  (50 on CPU, 30 elsewhere) or when it reads more than `realize_reads_threshold` (4) buffers;
- any pointwise body that reads more than the accumulated-reads threshold (12 on CPU, 8
  elsewhere), or exceeds the opcount threshold and reads more than one buffer, is realized;
- views are lazy: a view of a body that is not a buffer is not one either.

Where these facts do not decide (an op whose lowering kind we do not know, a count near a
threshold, a tiny reduction that may be unrolled), the node is `EITHER`: the liveness counts it
as a buffer *and* keeps its inputs alive until its consumers run, an upper bound of both outcomes.
Under-predicting the peak would break the budget promise, so every doubt resolves upwards.
"""

from __future__ import annotations

from dataclasses import dataclass

# Kinds of op, as Inductor lowers them.
INPUT = "input"  # graph input: a buffer the caller owns
POINTWISE = "pointwise"  # lowered to a Pointwise body (may be inlined into its consumers)
REDUCTION = "reduction"  # lowered to a Reduction: realized
SMALL_REDUCTION = "small_reduction"  # may be unrolled into a pointwise body
VIEW = "view"  # lazy view of its first input
EXTERN = "extern"  # fallback / library kernel (mm, conv, attention, ...), mutation: a buffer
MEMBER = "member"  # one output of a multi-output op (getitem): a buffer if its producer is
OTHER = "other"  # lowered, but we do not know whether to a body or to a buffer

# Fates.
MATERIALIZED = "materialized"
INLINED = "inlined"
EITHER = "either"

# Ops whose reused result Inductor realizes on CPU (ir.py should_realize_on_reuse).
HEAVY_OPS = frozenset({"exp", "log", "log10", "log1p", "log2", "sigmoid", "tanh"})


@dataclass(frozen=True)
class OpFacts:
    """One FX node, as the fusion rules see it."""

    name: str
    kind: str
    inputs: tuple[str, ...] = ()  # tensor arguments in order, repeats kept (each is one load)
    constants: int = 0  # non-tensor arguments (each is one op of the body)
    is_output: bool = False  # read by the graph's output node
    heavy: bool = False  # one of HEAVY_OPS
    realizes_inputs: bool = False  # Inductor realizes its inputs (extern kernels, as_strided, ...)


@dataclass(frozen=True)
class FusionRules:
    """Inductor's thresholds (torch/_inductor/config.py, torch 2.13)."""

    reads_threshold: int = 4  # realize_reads_threshold
    acc_reads_threshold: int = 12  # realize_cpu_acc_reads_threshold (8 on GPU)
    opcount_threshold: int = 50  # realize_cpu_opcount_threshold (30 on GPU)
    realize_heavy_on_reuse: bool = True  # the CPU heuristic for exp/log/sigmoid/tanh
    # Our op count is an estimate of Inductor's `inner_fn_opcount`: counts within this factor of
    # a threshold are undecided (EITHER).
    opcount_slack: float = 1.5

    @staticmethod
    def for_device(device_type: str) -> "FusionRules":
        if device_type == "cpu":
            return FusionRules()
        return FusionRules(acc_reads_threshold=8, opcount_threshold=30, realize_heavy_on_reuse=False)


@dataclass(frozen=True)
class FusionPrediction:
    inlined: frozenset[str]  # never a buffer: consumers read its inputs
    either: frozenset[str]  # counted as a buffer and as inlined (upper bound of both)

    def fate(self, name: str) -> str:
        if name in self.inlined:
            return INLINED
        return EITHER if name in self.either else MATERIALIZED


@dataclass(frozen=True)
class _Body:
    """What a consumer that inlines a node loads and computes: buffers read, the ops of the body
    (inlined nodes, each with its constant arguments), heavy ops."""

    reads: frozenset[str]
    nodes: frozenset[str]
    ops_of_nodes: int
    heavy: bool

    @property
    def ops(self) -> int:
        # Inductor counts the ops of the body after common-subexpression elimination: a node
        # inlined twice, or a buffer loaded twice at the same index, counts once.
        return self.ops_of_nodes + len(self.reads)


def predict_fusion(ops: tuple[OpFacts, ...] | list[OpFacts], rules: FusionRules = FusionRules()) -> FusionPrediction:
    """Fates of the ops of one graph, given in topological (graph) order."""
    by_name = {op.name: op for op in ops}
    users: dict[str, list[str]] = {op.name: [] for op in ops}
    for op in ops:
        for i in dict.fromkeys(op.inputs):
            if i in users:
                users[i].append(op.name)

    fate: dict[str, str] = {}
    # Two scenarios for undecided producers: A treats them as buffers, B as inlined bodies.
    body_a: dict[str, _Body] = {}
    body_b: dict[str, _Body] = {}

    def base_of(name: str) -> str:
        while name in by_name and by_name[name].kind == VIEW and by_name[name].inputs:
            name = by_name[name].inputs[0]
        return name

    def uses(name: str) -> tuple[list[OpFacts], bool, bool]:
        """(non-view consumers reached through views, reaches the output, used more than once)."""
        consumers, reaches_output, multi = [], False, False
        stack, seen = [name], set()
        while stack:
            n = stack.pop()
            if n in seen:
                continue
            seen.add(n)
            reaches_output |= by_name[n].is_output
            multi |= len(users[n]) + int(by_name[n].is_output) > 1
            for u in users[n]:
                if by_name[u].kind == VIEW:
                    if by_name[u].realizes_inputs:
                        consumers.append(by_name[u])
                    stack.append(u)
                else:
                    consumers.append(by_name[u])
        return consumers, reaches_output, multi

    def body(op: OpFacts, bodies: dict[str, _Body], inline_either: bool) -> _Body:
        reads: set[str] = set()
        nodes = {op.name}
        heavy = op.heavy
        for i in op.inputs:
            b = base_of(i)
            f = fate.get(b, MATERIALIZED)
            if f == INLINED or (f == EITHER and inline_either):
                inner = bodies[b]
                reads |= inner.reads
                nodes |= inner.nodes
                heavy |= inner.heavy
            else:
                reads.add(b)
        ops_of_nodes = sum(1 + by_name[n].constants for n in nodes)
        return _Body(frozenset(reads), frozenset(nodes), ops_of_nodes, heavy)

    def realized(b: _Body, multi: bool, slack: float) -> bool:
        ops = b.ops * slack
        large = ops > rules.opcount_threshold
        if multi and ((rules.realize_heavy_on_reuse and b.heavy) or large or len(b.reads) > rules.reads_threshold):
            return True
        return len(b.reads) > rules.acc_reads_threshold or (large and len(b.reads) > 1)

    for op in ops:
        if op.kind == VIEW:
            fate[op.name] = fate.get(base_of(op.name), MATERIALIZED)
            continue
        if op.kind not in (POINTWISE, OTHER, SMALL_REDUCTION):
            fate[op.name] = MATERIALIZED
            continue
        consumers, reaches_output, multi = uses(op.name)
        a = body_a[op.name] = body(op, body_a, inline_either=False)
        b = body_b[op.name] = body(op, body_b, inline_either=True)
        if reaches_output or not consumers or any(c.kind in (EXTERN, MEMBER) or c.realizes_inputs
                                                  for c in consumers):
            fate[op.name] = MATERIALIZED
            continue
        in_a = realized(a, multi, 1 / rules.opcount_slack)
        in_b = realized(b, multi, rules.opcount_slack)
        if in_a and in_b:
            verdict = MATERIALIZED
        elif not in_a and not in_b:
            verdict = INLINED
        else:
            verdict = EITHER
        # An op whose lowering kind is unknown, or a consumer that may realize its inputs (cat,
        # scatter, ...): only the buffer outcome is certain if the rules say so.
        uncertain = op.kind != POINTWISE or any(c.kind == OTHER for c in consumers)
        if verdict == INLINED and uncertain:
            verdict = EITHER
        fate[op.name] = verdict

    return FusionPrediction(
        inlined=frozenset(n for n, f in fate.items() if f == INLINED),
        either=frozenset(n for n, f in fate.items() if f == EITHER),
    )
