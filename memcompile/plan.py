"""The plan a compiled graph runs with: plain records, readable and serialisable."""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass


def format_bytes(n: float) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"


class TextEnum(str, enum.Enum):
    """A closed set of words that are also their own text: `==` with the string, JSON, f-strings
    and logs all see the value (enum.StrEnum, which Python 3.10 lacks)."""

    def __str__(self) -> str:
        return str(self.value)


class Choice(TextEnum):
    """What happens to one saved activation between its forward and its backward."""

    KEEP = "keep"
    RECOMPUTE = "recompute"  # computed again in the backward
    QUANTIZE = "quantize"  # held as a compressed copy on the device
    OFFLOAD = "offload"  # held as a copy in host memory


class StatusKind(TextEnum):
    """How a plan was found: the head of Plan.solver_status (status_text spells the whole)."""

    FITS = "fits"  # nothing to do: every activation kept fits
    OPTIMAL = "optimal"
    FEASIBLE = "feasible"  # the solver stopped at its time limit
    FALLBACK = "fallback"  # the greedy plan
    INFEASIBLE = "infeasible"  # no plan within the budget (a solution's status; a plan never has it)
    LEAST_PEAK = "least_peak"  # at the smallest budget; detail: how that plan was found (optimal, ...)
    STOCK_PARTITION = "stock_partition"  # PyTorch's partition; detail: activation_memory_budget=<fraction>
    STOCK_FALLBACK = "stock_fallback"  # planning failed; detail: the error's type


def status_text(kind: StatusKind, detail: str = "") -> str:
    """Plan.solver_status as plans and their files spell it: "least_peak_optimal",
    "stock_partition (activation_memory_budget=0.5)", "fits"."""
    if kind is StatusKind.LEAST_PEAK:
        return f"{kind}_{detail}"
    return f"{kind} ({detail})" if detail else str(kind)


def read_status(status: str) -> tuple[StatusKind | None, str]:
    """The kind and detail of a status_text; kind None for a status memcompile does not write."""
    least_peak = f"{StatusKind.LEAST_PEAK}_"
    if status.startswith(least_peak):
        return StatusKind.LEAST_PEAK, status[len(least_peak):]
    head, _, detail = status.partition(" (")
    try:
        return StatusKind(head), detail.removesuffix(")")
    except ValueError:  # not a kind: a hand-made plan's, or a newer memcompile's
        return None, ""


@dataclass(frozen=True)
class Decision:
    """What happens to one forward tensor the backward needs."""

    name: str
    op: str
    shape: tuple[int, ...]
    dtype: str
    nbytes: int
    choice: Choice
    time_cost_s: float  # estimated added step time of this choice
    reason: str  # why the alternatives were not possible, if they were not
    source: str  # the user's line that produced it, when known
    format: str = ""  # quantize: "int8" | "fp8" | "bf16"; offload: "host"
    held_bytes: int = -1  # device bytes it holds from forward to backward (-1: not recorded)

    @property
    def label(self) -> str:
        return f"{self.choice}:{self.format}" if self.format and self.choice == Choice.QUANTIZE else str(self.choice)


@dataclass(frozen=True)
class Plan:
    graph_id: str
    budget_bytes: int
    reserve_bytes: int
    predicted_peak_before_bytes: int  # every needed activation kept (stock behaviour, no recompute)
    predicted_peak_bytes: int
    peak_phase: str
    peak_node: str
    peak_breakdown: tuple[tuple[str, int], ...]
    decisions: tuple[Decision, ...]
    added_time_s: float
    solver_status: str  # status_text(kind, detail): read back by status_kind (read_status)
    solve_s: float
    gap: float
    live_bytes_before: tuple[int, ...]  # per step, forward then backward
    live_bytes_after: tuple[int, ...]
    # Symbolic sizes the plan was made for, as (symbol, size): it covers every size <= these
    # (larger ones are re-planned before they run). Empty for static shapes.
    size_bounds: tuple[tuple[str, int], ...] = ()
    library_workspace_bytes: int = 0  # part of reserve_bytes: the matmul library's workspaces
    compile_scratch_bytes: int = 0  # part of reserve_bytes: what a compile during the step allocates
    # Rewrites of the user's graph before planning (passes/loss_head.py), one line each.
    graph_rewrites: tuple[str, ...] = ()
    # Estimated step time those rewrites add by themselves (chunked ops, their recomputed
    # projections), beyond added_time_s, which prices the plan's decisions on the rewritten graph.
    rewrite_time_s: float = 0.0
    # The graphs compile under Inductor's own buffer reuse and fusion rules, not memcompile's
    # (_torch_private.inductor_rules): PyTorch's partition checked
    # within the budget under them, so it runs as PyTorch's own compile does.
    stock_inductor_rules: bool = False
    budget_source: str = ""  # where budget_bytes came from when relative to the device (budget("90%"), "free")
    optimizer_reserve_bytes: int = 0  # part of reserve_bytes: the optimizer's state (budget(optimizer=...))
    optimizer_source: str = ""  # how that was counted
    check_s: float = 0.0  # time spent checking candidate plans' liveness exactly (beside solve_s)
    # live_bytes_after split by category (passes/liveness.py CATEGORIES): (category, bytes per step)
    live_categories_after: tuple[tuple[str, tuple[int, ...]], ...] = ()
    # (name, category, bytes) of the largest storages live at the predicted peak, largest first
    peak_tensors: tuple[tuple[str, str, int], ...] = ()
    backward_from_step: int = -1  # index of the first backward step in live_bytes_after (-1: unknown)
    # Read back from the plan store (memcompile/plan_store.py): planned by an earlier launch for
    # this exact graph, options and machine, so not searched or checked again.
    from_plan_store: bool = False
    # Measured in an earlier step (memcompile/step_meter.py): what eager code holds as this
    # graph's backward starts (a loss computed on its output), planned for at that step, and the
    # part of reserve_bytes eager code holds beside the step at other times; where it was seen.
    eager_at_backward_start_bytes: int = 0
    eager_outside_bytes: int = 0
    eager_where: str = ""

    @property
    def total_added_time_s(self) -> float:
        """The estimated step time the plan adds over plain Inductor: decisions and rewrites."""
        return self.added_time_s + self.rewrite_time_s

    @property
    def status_kind(self) -> StatusKind | None:
        return read_status(self.solver_status)[0]

    @property
    def step_budget_bytes(self) -> int:
        return self.budget_bytes - self.reserve_bytes

    def choices(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for d in self.decisions:
            counts[d.label] = counts.get(d.label, 0) + 1
        return counts

    def totals(self) -> dict[str, tuple[int, int, int, float]]:
        """Per choice: (count, bytes, device bytes held until backward, estimated time)."""
        out: dict[str, tuple[int, int, int, float]] = {}
        for d in self.decisions:
            count, nbytes, held, secs = out.get(d.label, (0, 0, 0, 0.0))
            out[d.label] = (count + 1, nbytes + d.nbytes, held + max(d.held_bytes, 0), secs + d.time_cost_s)
        return out

    def summary(self) -> str:
        kept = sum(d.nbytes for d in self.decisions if d.choice == Choice.KEEP)
        recomputed = sum(d.nbytes for d in self.decisions if d.choice == Choice.RECOMPUTE)
        stored = [(label, t) for label, t in sorted(self.totals().items()) if label not in (Choice.KEEP, Choice.RECOMPUTE)]
        lines = [
            f"memcompile plan for {self.graph_id}: budget {format_bytes(self.budget_bytes)}"
            + (f" (reserve {format_bytes(self.reserve_bytes)})" if self.reserve_bytes else ""),
            f"  predicted peak {format_bytes(self.predicted_peak_before_bytes)} -> "
            f"{format_bytes(self.predicted_peak_bytes)} at {self.peak_phase} node {self.peak_node}",
            f"  saved activations: keep {format_bytes(kept)}, recompute {format_bytes(recomputed)} "
            + "".join(f", {label} {format_bytes(t[1])} -> {format_bytes(t[2])}" for label, t in stored)
            + f" ({self.choices()}); added time ~{self.total_added_time_s * 1e3:.2f} ms"
            + (f" (rewrites ~{self.rewrite_time_s * 1e3:.2f} ms)" if self.rewrite_time_s else ""),
            f"  solver {self.solver_status} in {self.solve_s:.2f} s, gap {self.gap:.1%}"
            + (", compiled under Inductor's own rules" if self.stock_inductor_rules else ""),
        ]
        if self.eager_at_backward_start_bytes or self.eager_outside_bytes:
            lines.append(f"  eager code outside the graph, measured: {format_bytes(self.eager_at_backward_start_bytes)} "
                         f"as its backward starts, {format_bytes(self.eager_outside_bytes)} beside it at other times"
                         + (f" (largest: {self.eager_where})" if self.eager_where else ""))
        if self.size_bounds:
            lines.append("  covers sizes " + ", ".join(f"{name} <= {size}" for name, size in self.size_bounds))
        return "\n".join(lines)


def status_words(status: str, gap: float) -> str:
    """A plan's solver status in plain words (Plan.solver_status and Plan.gap)."""
    kind, detail = read_status(status)
    if kind is StatusKind.FITS:
        return "fits with every activation kept: nothing to recompute"
    if kind is StatusKind.OPTIMAL:
        return "the least added time within the budget (proven optimal)"
    if kind is StatusKind.FEASIBLE:
        if not 0 <= gap <= 1:
            return "within the budget; the solver stopped at its time limit before bounding how good its plan is"
        return (f"within the budget; the solver stopped at its time limit: a better plan could save at most "
                f"{gap:.0%} of the time this one adds")
    if kind is StatusKind.FALLBACK:
        if detail:
            return f"within the budget by the greedy plan with recomputations kept back ({detail})"
        return "within the budget by the greedy plan (the solver found nothing better in its time)"
    if kind is StatusKind.LEAST_PEAK:
        return ("at or near the least memory memcompile can plan: the budget is at or near the smallest that "
                "works, so the plan comes from the least-peak search (its first plan within the budget) and "
                "does not weigh time")
    if kind is StatusKind.STOCK_PARTITION:
        fraction = detail[detail.find("=") + 1:] if "=" in detail else "?"
        return (f"PyTorch's own partition (activation_memory_budget={fraction}) fits, so it runs as is: "
                "it was measured faster than memcompile's plans at equal memory")
    if kind is StatusKind.STOCK_FALLBACK:
        return f"planning failed ({detail}): PyTorch's default partition runs " \
               "and the budget is NOT enforced"
    return status


def input_name(placeholder: str) -> str:
    """A Dynamo graph input's name as the module spells it:
    l_self_modules_h_modules_0_parameters_weight_ -> h.0.weight, l_x_ -> x."""
    name = placeholder.removeprefix("l_").rstrip("_").removeprefix("self_")
    for prefix in ("modules_", "parameters_", "buffers_"):
        name = name.removeprefix(prefix)
    for token in ("_modules_", "_parameters_", "_buffers_"):
        name = name.replace(token, ".")
    return name or placeholder


def with_input_names(tensors: tuple[tuple[str, str, int], ...], placeholders: tuple[str, ...]
                     ) -> tuple[tuple[str, str, int], ...]:
    """Plan.peak_tensors with the joint graph's primals_N named after the N-th graph input."""
    named = []
    for label, category, nbytes in tensors:
        match = re.fullmatch(r"primals_(\d+)", label)
        if match and 0 < int(match.group(1)) <= len(placeholders):
            label = input_name(placeholders[int(match.group(1)) - 1])
        named.append((label, category, nbytes))
    return tuple(named)
