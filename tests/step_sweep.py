"""Random training steps under random budgets, and the rule every one of them must meet.

A case is a small model (MLP, convolution or attention blocks; dropout, bf16 autocast and
checkpoint annotations drawn at random) with 0-3 graph breaks between its blocks, or one inside
the loop over its blocks (Dynamo then skips the whole frame), and a budget drawn from far below
the step's floor to above its keep-all peak. The rule (issue 31: never over budget in silence):

- it runs: every step, the first included, measures peak <= budget, gradients equal the
  reference (eager; PyTorch's own partition with the same seed where random ops are drawn);
- or it raises InfeasibleBudgetError naming a floor above the budget, and a run at that floor
  meets this rule (the first step of several regions names the floor of the regions it has
  seen: a run there may name a larger one, at most once per region);
- or it raises StepOverrunError before running over, and running the step again meets the rule;
- or, with a graph break inside the loop, it raises UnplannedFrameError before running (or first
  InfeasibleBudgetError for a region compiled before the skipped frame, and at that floor UnplannedFrameError).

Used by tests/test_step_sweep.py (codegen="aot_eager", a few cases) and benchmarks/budget_sweep.py
(Inductor, hundreds of cases).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import random
import time
import traceback
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

import memcompile
from torch._inductor import config as _inductor_config

KINDS = ("mlp", "conv", "attention")
CHECKPOINTS = ("none", "plain", "policy")
STEPS = 3
SEED = 1234


def bf16_autocast_supported() -> bool:
    try:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return (torch.ones(2, 2) @ torch.ones(2, 2)).dtype == torch.bfloat16
    except (RuntimeError, AssertionError):
        return False


@dataclass(frozen=True)
class Case:
    kind: str  # "mlp" | "conv" | "attention"
    depth: int  # blocks, 1-4
    width: int  # features (mlp, attention) or spatial size (conv)
    batch: int
    dropout: float  # 0.0: no random ops
    autocast: bool  # the blocks under bf16 autocast
    checkpoint: str  # "none" | "plain" (torch.utils.checkpoint per block) | "policy" (selective)
    breaks: tuple[int, ...]  # graph breaks after these blocks
    break_in_loop: bool  # the blocks run in a loop and the breaks sit inside it
    budget_fraction: float  # 0..1: where the budget lies, log-uniform, in budget_range
    seed: int = 0
    budget_range: tuple[float, float] = (0.2, 1.2)  # the budget's range, in multiples of the keep-all step peak

    def describe(self) -> str:
        extras = [f"p={self.dropout}" if self.dropout else "", "bf16" if self.autocast else "",
                  f"ckpt={self.checkpoint}" if self.checkpoint != "none" else "",
                  f"breaks={list(self.breaks)}{' in loop' if self.break_in_loop else ''}" if self.breaks else ""]
        return f"{self.kind} x{self.depth} w{self.width} b{self.batch} " + " ".join(e for e in extras if e)


def draw_case(rng: random.Random) -> Case:
    kind = rng.choice(KINDS)
    depth = rng.randint(1, 4)
    breaks = tuple(sorted(rng.sample(range(depth - 1), rng.randint(0, min(3, depth - 1))))) if depth > 1 else ()
    return Case(
        kind=kind, depth=depth,
        width={"mlp": rng.choice([16, 32, 48]), "conv": rng.choice([8, 12]), "attention": rng.choice([16, 32])}[kind],
        batch={"mlp": rng.choice([64, 128, 256]), "conv": rng.choice([2, 4]), "attention": rng.choice([2, 4, 8])}[kind],
        dropout=rng.choice([0.0, 0.0, 0.1, 0.3]),
        autocast=rng.random() < 0.25 and bf16_autocast_supported(),
        checkpoint=rng.choice(["none", "none", "plain", "policy"]),
        breaks=breaks, break_in_loop=bool(breaks) and rng.random() < 0.15,
        budget_fraction=rng.random(), seed=rng.randint(0, 2**16))


def _keep_sin_recompute_gelu(ctx, op, *args, **kwargs):
    if op is torch.ops.aten.sin.default:
        return CheckpointPolicy.MUST_SAVE
    if op is torch.ops.aten.gelu.default:
        return CheckpointPolicy.MUST_RECOMPUTE
    return CheckpointPolicy.PREFER_RECOMPUTE


class _MlpBlock(nn.Module):
    def __init__(self, d: int, p: float) -> None:
        super().__init__()
        self.up, self.down, self.p = nn.Linear(d, 2 * d), nn.Linear(2 * d, d), p

    def forward(self, x):
        h = F.dropout(F.gelu(self.up(x)), self.p, training=True) if self.p else F.gelu(self.up(x))
        return torch.tanh(x + self.down(h.sin()))


class _ConvBlock(nn.Module):
    def __init__(self, channels: int, p: float) -> None:
        super().__init__()
        self.conv, self.norm, self.p = nn.Conv2d(channels, channels, 3, padding=1), nn.BatchNorm2d(channels), p

    def forward(self, x):
        h = F.relu(self.norm(self.conv(x)))
        if self.p:
            h = F.dropout2d(h, self.p, training=True)
        return x + h.sin()


class _AttentionBlock(nn.Module):
    def __init__(self, d: int, p: float, heads: int = 2) -> None:
        super().__init__()
        self.heads, self.p = heads, p
        self.norm, self.qkv, self.proj = nn.LayerNorm(d), nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.mlp = _MlpBlock(d, p)

    def forward(self, x):
        b, s, d = x.shape
        q, k, v = self.qkv(self.norm(x)).view(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        att = F.scaled_dot_product_attention(q, k, v, dropout_p=self.p)
        return self.mlp(x + self.proj(att.transpose(1, 2).reshape(b, s, d)))


class SweepModel(nn.Module):
    """The case's blocks and loss; graph breaks unrolled between blocks, or inside the loop."""

    def __init__(self, case: Case) -> None:
        super().__init__()
        self.case = case
        make = {"mlp": lambda: _MlpBlock(case.width, case.dropout),
                "conv": lambda: _ConvBlock(8, case.dropout),
                "attention": lambda: _AttentionBlock(case.width, case.dropout)}[case.kind]
        self.blocks = nn.ModuleList(make() for _ in range(case.depth))

    def _block(self, i: int, x):
        block = self.blocks[i]
        if self.case.checkpoint == "plain":
            return checkpoint(block, x, use_reentrant=False)
        if self.case.checkpoint == "policy":
            context = functools.partial(create_selective_checkpoint_contexts, _keep_sin_recompute_gelu)
            return checkpoint(block, x, use_reentrant=False, context_fn=context)
        return block(x)

    def _blocks(self, x):
        if self.case.break_in_loop:
            for i in range(self.case.depth):
                x = self._block(i, x)
                if i in self.case.breaks:
                    torch._dynamo.graph_break()
            return x
        # Unrolled: a graph break inside a loop would make Dynamo skip the frame.
        x = self._block(0, x)
        if 0 in self.case.breaks:
            torch._dynamo.graph_break()
        if self.case.depth > 1:
            x = self._block(1, x)
        if 1 in self.case.breaks:
            torch._dynamo.graph_break()
        if self.case.depth > 2:
            x = self._block(2, x)
        if 2 in self.case.breaks:
            torch._dynamo.graph_break()
        if self.case.depth > 3:
            x = self._block(3, x)
        return x

    def forward(self, x):
        if self.case.autocast:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                x = self._blocks(x)
        else:
            x = self._blocks(x)
        return x.float().pow(2).mean()


def build(case: Case) -> tuple[SweepModel, torch.Tensor]:
    torch.manual_seed(case.seed)
    model = SweepModel(case)
    if case.kind == "conv":
        x = torch.randn(case.batch, 8, case.width, case.width)
    elif case.kind == "attention":
        x = torch.randn(case.batch, 16, case.width)
    else:
        x = torch.randn(case.batch, case.width)
    return model, x.requires_grad_(True)


@dataclass(frozen=True)
class Outcome:
    case: Case
    budget_bytes: int
    outcome: str  # "ran" | "infeasible" | "overrun" | "unplanned" | "crash"
    ok: bool  # meets the rule
    peaks: tuple[int, ...]  # measured, per step (of the run that ran)
    predicted_bytes: int  # the step's predicted peak, of the run that ran (0: none ran)
    floor_bytes: int  # the floor named by InfeasibleBudgetError (0: none)
    floor_runs: int  # runs at a named floor before one ran (0: none needed)
    max_grad_error: float
    note: str
    seconds: float
    # over every run of the case: plans compiled on an estimate (their compile's schedule checks
    # them), and those it did not confirm (planned again with checks)
    deferred_checks: int = 0
    deferred_checks_failed: int = 0


def _step(model, x, params, compiled, seed: int) -> int:
    for p in params:
        p.grad = None
    torch.manual_seed(seed)
    return memcompile.measure_peak(lambda: compiled(x).backward(), live_at_start=[model, x]).peak_bytes


@dataclass(frozen=True)
class Reference:
    """The gradients a run must give, and per tensor how far rounding alone moves them."""

    grads: tuple[torch.Tensor, ...]
    rounding: tuple[float, ...]  # max |difference| two exact compilations of the step give (0: none)


def _reference_grads(case: Case, model, x, params, codegen: str, emulate_casts: bool = False) -> list[torch.Tensor]:
    if not case.dropout and not (case.autocast and codegen == "inductor"):
        for p in params:
            p.grad = None
        torch.manual_seed(SEED)
        model(x).backward()
        return [p.grad.clone() for p in params]
    compiled = torch.compile(model, backend="inductor" if codegen == "inductor" else "aot_eager_decomp_partition")
    try:
        with _inductor_config.patch(emulate_precision_casts=emulate_casts):
            for p in params:
                p.grad = None
            torch.manual_seed(SEED)
            compiled(x).backward()
        return [p.grad.clone() for p in params]
    finally:
        torch.compiler.reset()


def _reference(case: Case, model, x, params, codegen: str = "aot_eager") -> Reference:
    """Eager gradients; where random ops are drawn, PyTorch's own partition compiled the way the
    case is (Inductor draws its random numbers its own way, from one seed per graph).

    Under bf16 autocast, Inductor's fused kernels keep intermediates in float32 where the graph
    rounds them to bf16, so any change of fusion (a recomputed activation fuses into the backward)
    moves gradients by bf16 roundings. How far is measured, not guessed: plain Inductor's
    gradients against its own with every bf16 rounding of the graph emulated."""
    grads = _reference_grads(case, model, x, params, codegen)
    rounding = [0.0] * len(grads)
    if case.autocast and codegen == "inductor":
        emulated = _reference_grads(case, model, x, params, codegen, emulate_casts=True)
        rounding = [float((a - b).abs().max()) for a, b in zip(grads, emulated)]
    return Reference(tuple(grads), tuple(rounding))


def keep_all_step_peak(case: Case, codegen: str) -> int:
    """The predicted step peak with a budget that needs nothing recomputed."""
    model, x = build(case)
    backend = memcompile.budget(10**12, codegen=codegen, time_limit_s=2, on_unplanned="warn")
    compiled = torch.compile(model, backend=backend)
    try:
        for _ in range(2):
            compiled(x).backward()
        return backend.predicted_step_peak()
    finally:
        torch.compiler.reset()


def budget_for(case: Case, keep_all: int) -> int:
    low, high = (math.log(x * keep_all) for x in case.budget_range)
    return int(math.exp(low + case.budget_fraction * (high - low)))


def _tolerances(case: Case) -> tuple[float, float]:
    if case.autocast:
        return 1.6e-2, 1.6e-2
    return 1e-4, 1e-5


def compare_grads(case: Case, expected: Reference, got: list[torch.Tensor]) -> tuple[float, bool]:
    """(max |difference|, whether every tensor is within tolerance, widened per tensor to twice
    the rounding spread the reference measured)."""
    rtol, atol = _tolerances(case)
    scale = max(float(g.abs().max()) for g in expected.grads) or 1.0
    error = max(float((a - b).abs().max()) for a, b in zip(expected.grads, got))
    match = all(torch.allclose(b, a, rtol=rtol, atol=max(atol * scale, 2 * spread))
                for a, b, spread in zip(expected.grads, got, expected.rounding))
    return error, match


def _attempt(case: Case, budget: int, codegen: str, expected) -> tuple[str, tuple[int, ...], int, int, float, str]:
    """One run of STEPS steps at `budget`: (outcome, peaks, predicted, floor, grad error, note).
    StepOverrunError is answered as it says: the step is run again (once)."""
    model, x = build(case)
    params = list(model.parameters()) + [x]
    backend = memcompile.budget(budget, codegen=codegen, time_limit_s=2)
    _BACKENDS.append(backend)
    compiled = torch.compile(model, backend=backend)
    peaks, retried = [], False
    try:
        while len(peaks) < STEPS:
            try:
                peaks.append(_step(model, x, params, compiled, SEED))
            except memcompile.StepOverrunError:
                if retried:
                    raise
                retried = True
        if expected is None:
            return "ran", tuple(peaks), backend.predicted_step_peak(), 0, 0.0, "ran with no reference"
        got = [p.grad.clone() for p in params]
        error, match = compare_grads(case, expected, got)
        over = [p for p in peaks if p > budget]
        note = ("over budget: " + ", ".join(map(str, over)) if over else "") + ("" if match else " gradients differ")
        return ("ran", tuple(peaks), backend.predicted_step_peak(), 0, error,
                note.strip() + (" (after a StepOverrunError)" if retried else ""))
    except memcompile.InfeasibleBudgetError as error:
        return "infeasible", tuple(peaks), 0, error.min_feasible_bytes, 0.0, "" if not peaks else "raised after running"
    except memcompile.StepOverrunError as error:
        return "overrun", tuple(peaks), 0, 0, 0.0, f"raised twice: {str(error)[:200]}"
    except memcompile.UnplannedFrameError:
        return "unplanned", tuple(peaks), 0, 0, 0.0, ""
    finally:
        torch.compiler.reset()


_BACKENDS: list = []  # the backends of the case being run (its deferred checks are counted)


def run_case(case: Case, codegen: str = "aot_eager", keep_all: int | None = None) -> Outcome:
    began = time.perf_counter()
    _BACKENDS.clear()
    try:
        outcome = _run_case(case, codegen, keep_all, began)
    except Exception as error:  # noqa: BLE001 - a sweep counts crashes, it must not stop at one
        torch.compiler.reset()
        outcome = Outcome(case, 0, "crash", False, (), 0, 0, 0, 0.0,
                          f"{type(error).__name__}: {error}\n{traceback.format_exc(limit=6)}",
                          time.perf_counter() - began)
    deferred = sum(b.deferred_checks for b in _BACKENDS)
    failed = sum(b.deferred_checks_failed for b in _BACKENDS)
    _BACKENDS.clear()
    return dataclasses.replace(outcome, deferred_checks=deferred, deferred_checks_failed=failed)


def _run_case(case: Case, codegen: str, keep_all: int | None, began: float) -> Outcome:
    model, x = build(case)
    params = list(model.parameters()) + [x]
    if case.break_in_loop:  # any budget: Dynamo skips the frame before a plan matters
        keep_all, expected = keep_all or 10**6, None
    else:
        expected = _reference(case, model, x, params, codegen)
        keep_all = keep_all if keep_all is not None else keep_all_step_peak(case, codegen)
    budget = budget_for(case, keep_all)
    outcome, peaks, predicted, floor, error, note = _attempt(case, budget, codegen, expected)
    elapsed = lambda: time.perf_counter() - began  # noqa: E731
    if outcome == "unplanned":
        return Outcome(case, budget, outcome, case.break_in_loop, peaks, 0, 0, 0, 0.0,
                       "" if case.break_in_loop else "UnplannedFrameError without a break in a loop", elapsed())
    if case.break_in_loop and outcome == "infeasible" and not peaks and floor > budget:
        # A region compiled before Dynamo reaches the skipped frame may be below its floor: a typed
        # error before running too. At the floor it names, the skipped frame must still be refused.
        at_floor = _attempt(case, floor, codegen, expected)[0]
        return Outcome(case, budget, outcome, at_floor == "unplanned", peaks, predicted, floor, 1, error,
                       "" if at_floor == "unplanned" else f"at the floor {floor}: {at_floor}", elapsed())
    if case.break_in_loop:
        return Outcome(case, budget, outcome, False, peaks, predicted, floor, 0, error,
                       f"a break in the loop ran as {outcome}", elapsed())
    if outcome == "ran":
        return Outcome(case, budget, outcome, not note or note.startswith("(after"), peaks, predicted, 0, 0,
                       error, note, elapsed())
    if outcome != "infeasible" or floor <= budget or note:
        return Outcome(case, budget, outcome, False, peaks, predicted, floor, 0, error,
                       note or f"floor {floor} <= budget {budget}", elapsed())
    # The named floor must be honoured by a run at it; a first step of several regions names the
    # floor of the regions it has seen, so a run there may name a larger one (once per region).
    named = floor
    for runs in range(1, case.depth + 2):
        at_floor, peaks, predicted, next_floor, error, note = _attempt(case, named, codegen, expected)
        if at_floor == "ran":
            good = not note or note.startswith("(after")
            return Outcome(case, budget, "infeasible", good, peaks, predicted, floor, runs, error,
                           note if note else "", elapsed())
        if at_floor != "infeasible" or next_floor <= named:
            return Outcome(case, budget, "infeasible", False, peaks, predicted, floor, runs, error,
                           f"at the floor {named}: {at_floor} {next_floor} {note}", elapsed())
        named = next_floor
    return Outcome(case, budget, "infeasible", False, (), 0, floor, case.depth + 1, 0.0,
                   f"no run at a named floor ran (last {named})", elapsed())


def summary(outcomes: list[Outcome]) -> dict:
    counts = {kind: sum(o.outcome == kind for o in outcomes)
              for kind in ("ran", "infeasible", "overrun", "unplanned", "crash")}
    return {"runs": len(outcomes), "ok": sum(o.ok for o in outcomes), **counts,
            "over_budget": sum(any(p > o.budget_bytes for p in o.peaks) and o.outcome == "ran" for o in outcomes),
            "floor_reruns": sum(o.floor_runs > 1 for o in outcomes),
            "grads_differ": sum("gradients differ" in o.note for o in outcomes)}


def as_row(outcome: Outcome) -> dict:
    row = dataclasses.asdict(outcome)
    row["case"] = dataclasses.asdict(outcome.case)
    row["describe"] = outcome.case.describe()
    return row
