"""The plan a compiled graph runs with: plain records, readable and serialisable."""

from __future__ import annotations

from dataclasses import dataclass


def format_bytes(n: float) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"


@dataclass(frozen=True)
class Decision:
    """What happens to one forward tensor the backward needs."""

    name: str
    op: str
    shape: tuple[int, ...]
    dtype: str
    nbytes: int
    choice: str  # "keep" | "recompute" | "quantize" | "offload"
    time_cost_s: float  # estimated added step time of this choice
    reason: str  # why the alternatives were not possible, if they were not
    source: str  # the user's line that produced it, when known
    format: str = ""  # quantize: "int8" | "fp8" | "bf16"; offload: "host"
    held_bytes: int = -1  # device bytes it holds from forward to backward (-1: not recorded)

    @property
    def label(self) -> str:
        return f"{self.choice}:{self.format}" if self.format and self.choice == "quantize" else self.choice


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
    solver_status: str  # "fits" (nothing to do) | "optimal" | "feasible" | "fallback" (greedy) | "least_peak_*" (at the smallest budget)
    solve_s: float
    gap: float
    live_bytes_before: tuple[int, ...]  # per step, forward then backward
    live_bytes_after: tuple[int, ...]
    # Symbolic sizes the plan was made for, as (symbol, size): it covers every size <= these
    # (larger ones are re-planned before they run). Empty for static shapes.
    size_bounds: tuple[tuple[str, int], ...] = ()
    library_workspace_bytes: int = 0  # part of reserve_bytes: the matmul library's workspaces
    # Rewrites of the user's graph before planning (passes/loss_head.py), one line each.
    graph_rewrites: tuple[str, ...] = ()
    # Estimated step time those rewrites add by themselves (chunked ops, their recomputed
    # projections), beyond added_time_s, which prices the plan's decisions on the rewritten graph.
    rewrite_time_s: float = 0.0
    # The graphs compile under Inductor's own buffer reuse and fusion rules, not memcompile's
    # (_torch_private.install_reuse_rule / install_fusion_rules): PyTorch's partition checked
    # within the budget under them, so it runs as PyTorch's own compile does.
    stock_inductor_rules: bool = False

    @property
    def total_added_time_s(self) -> float:
        """The estimated step time the plan adds over plain Inductor: decisions and rewrites."""
        return self.added_time_s + self.rewrite_time_s

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
        kept = sum(d.nbytes for d in self.decisions if d.choice == "keep")
        recomputed = sum(d.nbytes for d in self.decisions if d.choice == "recompute")
        stored = [(label, t) for label, t in sorted(self.totals().items()) if label not in ("keep", "recompute")]
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
        if self.size_bounds:
            lines.append("  covers sizes " + ", ".join(f"{name} <= {size}" for name, size in self.size_bounds))
        return "\n".join(lines)
