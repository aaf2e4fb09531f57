"""Views of plans: a text report, a JSON file that loads back into `Plan`s, and an HTML picture.

    memcompile.dump(backend)                      # text
    memcompile.dump(backend, format="json", path="plans.json")
    load_plans("plans.json")                      # -> [Plan, ...], equal to the dumped ones
    MEMCOMPILE_DUMP_DIR=out python train.py       # out/<graph_id>.json and .html per compiled graph
    python -m memcompile dump out/graph_0.json --html graph_0.html
"""

from __future__ import annotations

import json
import logging
import math
import re
import types
from dataclasses import asdict, dataclass
from html import escape
from pathlib import Path
from typing import Any, Iterable, Sequence

from memcompile.plan import Choice, Decision, Plan, StatusKind, format_bytes, status_words

log = logging.getLogger("memcompile")

# 2 added decision format/held_bytes; 3 the budget's source, the optimizer reserve, check time, live
# bytes by category and the largest tensors at the peak (version 1 and 2 files still load)
SCHEMA_VERSION = 3
FORMATS = ("text", "json", "html")
MIB = 2**20


# -- which plans ---------------------------------------------------------------------------------

def is_backend(obj: object) -> bool:
    """A memcompile Backend, known by its class's marker (this module is below backend.py, which
    writes plans with it; a compiled module forwards attribute reads, so its class is asked)."""
    return bool(getattr(type(obj), "MEMCOMPILE_BACKEND", False))


def plans_of(obj: object) -> list[Plan]:
    """The plans behind a Plan, a list of plans, a Backend, or a torch.compile result."""
    if isinstance(obj, Plan):
        return [obj]
    if is_backend(obj):
        return list(obj.plans)
    if isinstance(obj, (list, tuple)) and all(isinstance(p, Plan) for p in obj):
        return list(obj)
    backend = find_backend(obj)
    if backend is not None:
        return list(backend.plans)
    raise TypeError(
        "memcompile.dump() takes a Backend, a Plan, a list of plans, or a model/function compiled "
        f"with torch.compile(..., backend=memcompile.budget(...)); got {type(obj).__name__} "
        "with no memcompile backend reachable from it"
    )


def find_backend(compiled: object, max_depth: int = 8, max_objects: int = 5000):
    """The memcompile Backend a torch.compile result was built with, or None.

    torch keeps it a few private attributes deep (module -> compile context -> frame callbacks ->
    backend wrappers). Naming those attributes would tie this to one torch release and put private
    torch API outside _torch_private/, so search the object's attributes and closures instead.
    """
    seen: set[int] = set()
    frontier: list[object] = [compiled]
    for _ in range(max_depth):
        following: list[object] = []
        for obj in frontier:
            if id(obj) in seen:
                continue
            seen.add(id(obj))
            if is_backend(obj):
                return obj
            following.extend(_referents(obj, is_root=obj is compiled))
        if len(seen) > max_objects:
            break
        frontier = following
    return None


_LEAVES = (str, bytes, int, float, complex, bool, type(None), type, types.ModuleType)


def _referents(obj: object, is_root: bool) -> list[object]:
    import torch

    if isinstance(obj, _LEAVES) or isinstance(obj, torch.Tensor):
        return []
    if isinstance(obj, torch.nn.Module) and not is_root:
        return []  # the user's model: large, and never holds the backend
    if isinstance(obj, dict):
        return list(obj.values())
    if isinstance(obj, (list, tuple, set, frozenset)):
        return list(obj)
    if isinstance(obj, types.FunctionType):
        # closures only: __globals__ leads to whole modules (and other backends)
        return [cell.cell_contents for cell in obj.__closure__ or () if _cell_is_set(cell)]
    if isinstance(obj, types.MethodType):
        return [obj.__func__, obj.__self__]
    try:
        return list(vars(obj).values())
    except TypeError:
        return []


def _cell_is_set(cell: types.CellType) -> bool:
    try:
        _ = cell.cell_contents
    except ValueError:
        return False
    return True


# -- text ----------------------------------------------------------------------------------------

def format_seconds(s: float) -> str:
    if s == 0:
        return "0"
    if not math.isfinite(s):
        return str(s)
    for unit, size in (("s", 1.0), ("ms", 1e-3), ("us", 1e-6)):
        if abs(s) >= size:
            return f"{s / size:.2f} {unit}"
    return f"{s / 1e-9:.0f} ns"


def format_change(before: int, after: int) -> str:
    if before == 0:
        return ""
    return f" ({(after - before) / before:+.1%})"


def reserve_parts(plan: Plan) -> str:
    """" (optimizer state X, cuBLAS workspaces Y)": what the reserve is made of, where known."""
    parts = [f"{what} {format_bytes(nbytes)}" for what, nbytes in (
        ("optimizer state", plan.optimizer_reserve_bytes), ("cuBLAS workspaces", plan.library_workspace_bytes),
        ("compile-time copies", plan.compile_scratch_bytes)) if nbytes]
    return f" ({', '.join(parts)})" if parts else ""


# Statuses of plans that minimise added time: their gap (to the solver's bound) means something.
# A least-peak plan minimises memory, so its time gap (100% against a bound of 0) says nothing.
_TIMED_STATUSES = (StatusKind.OPTIMAL, StatusKind.FEASIBLE, StatusKind.FALLBACK)


def plan_text(plan: Plan) -> str:
    lines = [
        f"memcompile plan {plan.graph_id}",
        f"  budget           {format_bytes(plan.budget_bytes)} ({plan.budget_bytes} B), "
        f"reserve {format_bytes(plan.reserve_bytes)}" + reserve_parts(plan)
        + f", step budget {format_bytes(plan.step_budget_bytes)}",
        *([f"  budget from      {plan.budget_source}"] if plan.budget_source else []),
        *([f"  optimizer        {plan.optimizer_source}"] if plan.optimizer_source else []),
        f"  predicted peak   {format_bytes(plan.predicted_peak_before_bytes)} -> "
        f"{format_bytes(plan.predicted_peak_bytes)}"
        f"{format_change(plan.predicted_peak_before_bytes, plan.predicted_peak_bytes)}"
        f" at {plan.peak_phase} node {plan.peak_node}",
        f"  solver           {plan.solver_status} in {plan.solve_s:.2f} s"
        + (f", gap {plan.gap:.1%}" if plan.status_kind in _TIMED_STATUSES else "")
        + (f"; checks {plan.check_s:.2f} s" if plan.check_s else "")
        + ("; read from the plan store (an earlier launch planned this graph)" if plan.from_plan_store else "")
        + (", compiled under Inductor's own rules" if plan.stock_inductor_rules else ""),
        f"  status           {status_words(plan.solver_status, plan.gap)}",
        f"  added step time  ~{format_seconds(plan.total_added_time_s)} (estimate"
        + (f": decisions ~{format_seconds(plan.added_time_s)}, rewrites ~{format_seconds(plan.rewrite_time_s)}"
           if plan.rewrite_time_s else "") + ")",
        *(f"  rewrite          {rewrite}" for rewrite in plan.graph_rewrites),
        "",
        *breakdown_lines(plan),
        *peak_tensor_lines(plan),
        "",
        *decision_lines(plan.decisions),
    ]
    return "\n".join(lines)


def breakdown_lines(plan: Plan) -> list[str]:
    total = sum(b for _, b in plan.peak_breakdown)
    lines = [f"  at the peak ({format_bytes(total)}):"]
    if not plan.peak_breakdown:
        return lines + ["    (no breakdown recorded)"]
    width = max(len(category) for category, _ in plan.peak_breakdown)
    for category, nbytes in sorted(plan.peak_breakdown, key=lambda cb: (-cb[1], cb[0])):
        share = f"{nbytes / total:6.1%}" if total else ""
        lines.append(f"    {category:<{width}}  {format_bytes(nbytes):>11}  {share}")
    return lines


def peak_tensor_lines(plan: Plan, count: int = 8) -> list[str]:
    if not plan.peak_tensors:
        return []
    rows = plan.peak_tensors[:count]
    width = max(len(name) for name, _, _ in rows)
    return ["  largest live at the peak:"] + [f"    {name:<{width}}  {format_bytes(nbytes):>11}  {category}"
                                               for name, category, nbytes in rows]


DECISION_COLUMNS = ("node", "op", "shape", "dtype", "bytes", "choice", "held", "time cost", "reason", "source")


def decision_row(d: Decision) -> tuple[str, ...]:
    held = format_bytes(d.held_bytes) if d.held_bytes >= 0 else "-"
    return (d.name, d.op, "[" + ", ".join(map(str, d.shape)) + "]", d.dtype, format_bytes(d.nbytes),
            d.label, held, format_seconds(d.time_cost_s), d.reason or "-", d.source or "-")


def decision_lines(decisions: Sequence[Decision]) -> list[str]:
    if not decisions:
        return ["  saved activations: none"]
    by_choice: dict[str, list[int]] = {}
    for d in decisions:
        by_choice.setdefault(d.label, []).append(d.nbytes)
    counts = ", ".join(f"{choice} {len(sizes)} = {format_bytes(sum(sizes))}" for choice, sizes in sorted(by_choice.items()))
    # largest first; a stable sort keeps the planner's (graph) order among equal sizes
    ordered = sorted(decisions, key=lambda d: -d.nbytes)
    rows = [DECISION_COLUMNS] + [decision_row(d) for d in ordered]
    widths = [max(len(row[i]) for row in rows) for i in range(len(DECISION_COLUMNS))]
    right_aligned = {DECISION_COLUMNS.index("bytes"), DECISION_COLUMNS.index("held"), DECISION_COLUMNS.index("time cost")}

    def line(row: tuple[str, ...]) -> str:
        cells = [cell.rjust(w) if i in right_aligned else cell.ljust(w) for i, (cell, w) in enumerate(zip(row, widths))]
        return ("    " + "  ".join(cells)).rstrip()

    return [f"  saved activations: {len(decisions)} ({counts}), largest first:"] + [line(r) for r in rows]


def to_text(plans: Sequence[Plan]) -> str:
    if not plans:
        return "memcompile: no plans (no graph with a backward pass compiled yet)"
    return "\n\n".join(plan_text(p) for p in plans)


# -- JSON ----------------------------------------------------------------------------------------

_PLAN_FLOATS = ("added_time_s", "solve_s", "gap", "check_s")


def _finite_or_name(x: float) -> float | str:
    # JSON has no inf/nan (the gap is inf when no solution was proven); spell them as strings
    return x if math.isfinite(x) else repr(x)


def plan_to_dict(plan: Plan) -> dict[str, Any]:
    data = asdict(plan)
    for key in _PLAN_FLOATS:
        data[key] = _finite_or_name(data[key])
    for d in data["decisions"]:
        d["time_cost_s"] = _finite_or_name(d["time_cost_s"])
    return data


def to_json(plans: Sequence[Plan]) -> str:
    document = {"schema_version": SCHEMA_VERSION, "plans": [plan_to_dict(p) for p in plans]}
    return json.dumps(document, indent=1, sort_keys=True, allow_nan=False) + "\n"


def _exact_keys(data: dict, expected: Iterable[str], what: str) -> None:
    expected = set(expected)
    missing, unknown = expected - data.keys(), data.keys() - expected
    if missing or unknown:
        raise ValueError(f"{what}: missing {sorted(missing)}, unknown {sorted(unknown)}")


_DECISION_ADDED_IN_2 = {"format": "", "held_bytes": -1}


def decision_from_dict(data: dict[str, Any]) -> Decision:
    data = {**_DECISION_ADDED_IN_2, **data}  # version 1 files lack these
    _exact_keys(data, Decision.__dataclass_fields__, "decision")
    return Decision(
        name=str(data["name"]), op=str(data["op"]), shape=tuple(int(s) for s in data["shape"]),
        dtype=str(data["dtype"]), nbytes=int(data["nbytes"]), choice=Choice(data["choice"]),
        time_cost_s=float(data["time_cost_s"]), reason=str(data["reason"]), source=str(data["source"]),
        format=str(data["format"]), held_bytes=int(data["held_bytes"]),
    )


# Plan fields older files lack, with the values a plan without them has.
_ADDED_LATER = {"library_workspace_bytes": 0, "compile_scratch_bytes": 0, "graph_rewrites": [], "rewrite_time_s": 0.0,
                "size_bounds": [],
                "stock_inductor_rules": False, "budget_source": "", "optimizer_reserve_bytes": 0,
                "optimizer_source": "", "check_s": 0.0, "live_categories_after": [], "peak_tensors": [],
                "backward_from_step": -1, "from_plan_store": False, "eager_at_backward_start_bytes": 0,
                "eager_outside_bytes": 0, "eager_where": ""}


def plan_from_json(data: dict[str, Any] | str) -> Plan:
    """One plan from its JSON object (a dict, or its text): an entry of a file's "plans" list."""
    if isinstance(data, str):
        data = json.loads(data)
    try:
        data = {**_ADDED_LATER, **data}  # older files
        _exact_keys(data, Plan.__dataclass_fields__, f"plan {data.get('graph_id', '?')}")
        return Plan(
            graph_id=str(data["graph_id"]),
            budget_bytes=int(data["budget_bytes"]),
            reserve_bytes=int(data["reserve_bytes"]),
            predicted_peak_before_bytes=int(data["predicted_peak_before_bytes"]),
            predicted_peak_bytes=int(data["predicted_peak_bytes"]),
            peak_phase=str(data["peak_phase"]),
            peak_node=str(data["peak_node"]),
            peak_breakdown=tuple((str(c), int(b)) for c, b in data["peak_breakdown"]),
            decisions=tuple(decision_from_dict(d) for d in data["decisions"]),
            added_time_s=float(data["added_time_s"]),
            solver_status=str(data["solver_status"]),
            solve_s=float(data["solve_s"]),
            gap=float(data["gap"]),
            live_bytes_before=tuple(int(b) for b in data["live_bytes_before"]),
            live_bytes_after=tuple(int(b) for b in data["live_bytes_after"]),
            size_bounds=tuple((str(n), int(v)) for n, v in data["size_bounds"]),
            library_workspace_bytes=int(data["library_workspace_bytes"]),
            compile_scratch_bytes=int(data["compile_scratch_bytes"]),
            graph_rewrites=tuple(str(r) for r in data["graph_rewrites"]),
            rewrite_time_s=float(data["rewrite_time_s"]),
            stock_inductor_rules=bool(data["stock_inductor_rules"]),
            budget_source=str(data["budget_source"]),
            optimizer_reserve_bytes=int(data["optimizer_reserve_bytes"]),
            optimizer_source=str(data["optimizer_source"]),
            check_s=float(data["check_s"]),
            live_categories_after=tuple((str(c), tuple(int(b) for b in series))
                                        for c, series in data["live_categories_after"]),
            peak_tensors=tuple((str(n), str(c), int(b)) for n, c, b in data["peak_tensors"]),
            backward_from_step=int(data["backward_from_step"]),
            from_plan_store=bool(data["from_plan_store"]),
            eager_at_backward_start_bytes=int(data["eager_at_backward_start_bytes"]),
            eager_outside_bytes=int(data["eager_outside_bytes"]),
            eager_where=str(data["eager_where"]),
        )
    except (AttributeError, KeyError, TypeError, ValueError) as error:
        raise ValueError(f"not a memcompile plan: {error}") from error


def plans_from_json(text: str) -> list[Plan]:
    document = json.loads(text)
    if not isinstance(document, dict) or "plans" not in document:
        raise ValueError('not a memcompile plan file: expected {"schema_version": 3, "plans": [...]}')
    version = document.get("schema_version")
    if version not in (1, 2, SCHEMA_VERSION):
        raise ValueError(f"plan file schema_version {version!r}; this memcompile reads 1 to {SCHEMA_VERSION}")
    return [plan_from_json(p) for p in document["plans"]]


def load_plans(path: str | Path) -> list[Plan]:
    return plans_from_json(Path(path).read_text(encoding="utf-8"))


# -- HTML picture --------------------------------------------------------------------------------

@dataclass(frozen=True)
class Frame:
    """Where the plot sits in the SVG, and the data range it shows."""

    width: int = 960
    height: int = 400
    left: int = 80
    right: int = 24
    top: int = 40
    bottom: int = 56
    steps: int = 1  # x: step index 0 .. steps-1
    y_max_bytes: float = 1.0

    def x(self, step: float) -> float:
        span = max(self.steps - 1, 1)
        return self.left + (self.width - self.left - self.right) * step / span

    def y(self, nbytes: float) -> float:
        plot = self.height - self.top - self.bottom
        return self.top + plot * (1 - nbytes / self.y_max_bytes)


def nice_step(span: float, count: int = 5) -> float:
    """A 1/2/5 x 10^k step giving about `count` intervals over `span`."""
    raw = span / count
    power = 10 ** math.floor(math.log10(raw))
    return next(m * power for m in (1, 2, 5, 10) if m * power >= raw)


def tick_label(value: float, step: float) -> str:
    decimals = max(0, -math.floor(math.log10(step)))
    return f"{value:.{decimals}f}"


def _num(x: float) -> str:
    return f"{x:.1f}"


# Labels drawn over the curves get a white outline behind the glyphs, so they stay readable.
HALO = 'stroke="white" stroke-width="3" paint-order="stroke"'


def _attr(value: object) -> str:
    return escape(str(value), quote=True)


def _polyline(frame: Frame, values: Sequence[int], css_class: str, stroke: str, dash: str, width: float) -> str:
    points = " ".join(f"{_num(frame.x(i))},{_num(frame.y(b))}" for i, b in enumerate(values))
    dash_attr = f' stroke-dasharray="{dash}"' if dash else ""
    return (f'<polyline class="{css_class}" points="{points}" fill="none" stroke="{stroke}" '
            f'stroke-width="{width}" stroke-linejoin="round"{dash_attr}/>')


def _peak_step(values: Sequence[int], peak: int) -> int:
    # the first step at the plan's peak; the curve's own maximum if they disagree
    return values.index(peak) if peak in values else max(range(len(values)), key=values.__getitem__)


# What each category of live bytes is called and drawn in (passes/liveness.py CATEGORIES), in
# the order they stack: what the step starts with at the bottom.
CATEGORY_STYLE = {  # colour, what they are, what one is
    "parameters_and_inputs": ("#9ecae1", "parameters and inputs", "parameter or input"),
    "gradients": ("#c5b0d5", "gradients", "gradient"),
    "saved_activations": ("#fd8d3c", "saved activations", "saved activation"),
    "outputs": ("#e7cb94", "outputs", "output"),
    "temporaries": ("#74c476", "temporaries", "temporary"),
    "op_scratch_and_workspace": ("#bdbdbd", "op scratch and workspace", "workspace"),
}


def category_words(category: str, one: bool = False) -> str:
    return CATEGORY_STYLE.get(category, ("", category.replace("_", " "), category.replace("_", " ")))[2 if one else 1]


def category_colour(category: str) -> str:
    return CATEGORY_STYLE.get(category, ("#dddddd", ""))[0]


def _category_series(plan: Plan) -> list[tuple[str, tuple[int, ...]]]:
    """The plan's live bytes by category, stacking order, when recorded for every step."""
    series = [(c, v) for c, v in plan.live_categories_after if len(v) == len(plan.live_bytes_after)]
    order = list(CATEGORY_STYLE)
    series.sort(key=lambda cv: order.index(cv[0]) if cv[0] in order else len(order))
    return [(c, v) for c, v in series if any(v)]


def _stack_polygons(frame: Frame, series: list[tuple[str, tuple[int, ...]]], peak_step: int) -> list[str]:
    parts, bottom = [], [0] * (len(series[0][1]) if series else 0)
    for category, values in series:
        top = [b + v for b, v in zip(bottom, values)]
        upper = [f"{_num(frame.x(i))},{_num(frame.y(t))}" for i, t in enumerate(top)]
        lower = [f"{_num(frame.x(i))},{_num(frame.y(b))}" for i, b in reversed(list(enumerate(bottom)))]
        at_peak = values[peak_step] if 0 <= peak_step < len(values) else 0
        parts.append(
            f'<polygon class="category" data-category="{_attr(category)}" data-peak-bytes="{at_peak}" '
            f'points="{" ".join(upper + lower)}" fill="{category_colour(category)}" fill-opacity="0.9" stroke="none">'
            f"<title>{escape(category_words(category))}: {escape(format_bytes(at_peak))} at the peak</title></polygon>")
        bottom = top
    return parts


def plan_svg(plan: Plan) -> str:
    before, after = plan.live_bytes_before, plan.live_bytes_after
    step_budget = plan.step_budget_bytes
    top_value = max([*before, *after, step_budget, plan.predicted_peak_bytes, plan.predicted_peak_before_bytes, 1])
    y_step = nice_step(top_value * 1.05 / MIB) * MIB
    y_max = math.ceil(top_value * 1.05 / y_step) * y_step
    frame = Frame(steps=max(len(before), len(after), 2), y_max_bytes=y_max)
    plot_right = frame.width - frame.right
    plot_bottom = frame.height - frame.bottom
    title = (f"{plan.graph_id}: live memory per step, peak {format_bytes(plan.predicted_peak_before_bytes)} -> "
             f"{format_bytes(plan.predicted_peak_bytes)} under a step budget of {format_bytes(step_budget)}")
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" class="timeline" viewBox="0 0 {frame.width} {frame.height}" '
        f'width="{frame.width}" height="{frame.height}" font-family="sans-serif" font-size="12" role="img" '
        f'data-graph-id="{_attr(plan.graph_id)}" data-predicted-peak-bytes="{plan.predicted_peak_bytes}" '
        f'data-step-budget-bytes="{step_budget}">',
        f"<title>{escape(title)}</title>",
        f'<rect x="0" y="0" width="{frame.width}" height="{frame.height}" fill="white"/>',
    ]
    peak_step = _peak_step(after, plan.predicted_peak_bytes) if after else -1
    # live bytes of the plan, stacked by category (under the grid lines' labels, over nothing)
    parts += _stack_polygons(frame, _category_series(plan), peak_step)
    # y grid and labels, in MiB
    tick = 0.0
    while tick <= y_max + y_step / 2:
        y = _num(frame.y(tick))
        parts.append(f'<line x1="{frame.left}" y1="{y}" x2="{plot_right}" y2="{y}" stroke="#000" stroke-opacity="0.1"/>')
        parts.append(f'<text x="{frame.left - 8}" y="{y}" text-anchor="end" dominant-baseline="middle" '
                     f'fill="#444">{tick_label(tick / MIB, y_step / MIB)}</text>')
        tick += y_step
    # x ticks: step indices
    x_step = max(1, int(nice_step(max(frame.steps - 1, 1), 8)))
    for i in range(0, frame.steps, x_step):
        x = _num(frame.x(i))
        parts.append(f'<line x1="{x}" y1="{plot_bottom}" x2="{x}" y2="{plot_bottom + 5}" stroke="#444"/>')
        parts.append(f'<text x="{x}" y="{plot_bottom + 18}" text-anchor="middle" fill="#444">{i}</text>')
    parts += [
        f'<line x1="{frame.left}" y1="{plot_bottom}" x2="{plot_right}" y2="{plot_bottom}" stroke="#444"/>',
        f'<line x1="{frame.left}" y1="{frame.top}" x2="{frame.left}" y2="{plot_bottom}" stroke="#444"/>',
        f'<text x="{(frame.left + plot_right) / 2}" y="{frame.height - 12}" text-anchor="middle" fill="#222">'
        "step (forward, then backward)</text>",
        f'<text transform="translate(18 {(frame.top + plot_bottom) / 2}) rotate(-90)" text-anchor="middle" '
        'fill="#222">live memory (MiB)</text>',
    ]
    if 0 < plan.backward_from_step < len(after):
        x = _num(frame.x(plan.backward_from_step - 0.5))
        parts += [
            f'<line class="phase-boundary" data-step="{plan.backward_from_step}" x1="{x}" y1="{frame.top}" x2="{x}" '
            f'y2="{plot_bottom}" stroke="#555" stroke-width="1" stroke-dasharray="2 3"/>',
            f'<text x="{_num(float(x) - 6)}" y="{frame.top + 14}" text-anchor="end" fill="#555" {HALO}>forward</text>',
            f'<text x="{_num(float(x) + 6)}" y="{frame.top + 14}" text-anchor="start" fill="#555" {HALO}>backward</text>',
        ]
    # budget line: what the step may use (budget - reserve)
    budget_y = _num(frame.y(step_budget))
    parts += [
        f'<line class="budget" data-bytes="{step_budget}" x1="{frame.left}" y1="{budget_y}" x2="{plot_right}" '
        f'y2="{budget_y}" stroke="#d1242f" stroke-width="1.5" stroke-dasharray="6 4"/>',
        f'<text x="{plot_right - 4}" y="{_num(frame.y(step_budget) - 6)}" text-anchor="end" fill="#d1242f" {HALO}>'
        f"step budget {escape(format_bytes(step_budget))}"
        + (f" (budget {escape(format_bytes(plan.budget_bytes))} - reserve {escape(format_bytes(plan.reserve_bytes))})"
           if plan.reserve_bytes else "")
        + "</text>",
    ]
    if before:
        parts.append(_polyline(frame, before, "before", "#555555", "4 3", 1.5))
    if after:
        parts.append(_polyline(frame, after, "after", "#1f3b73", "", 1.5))
    if before:
        i = _peak_step(before, plan.predicted_peak_before_bytes)
        parts.append(
            f'<circle class="peak-before" data-peak-bytes="{plan.predicted_peak_before_bytes}" data-step="{i}" '
            f'cx="{_num(frame.x(i))}" cy="{_num(frame.y(plan.predicted_peak_before_bytes))}" r="4" fill="#555555">'
            f"<title>peak without the plan: {escape(format_bytes(plan.predicted_peak_before_bytes))} at step {i}"
            "</title></circle>")
        parts.append(f'<text x="{_num(frame.x(i))}" y="{_num(frame.y(plan.predicted_peak_before_bytes) - 9)}" '
                     f'text-anchor="middle" fill="#444" {HALO}>'
                     f"{escape(format_bytes(plan.predicted_peak_before_bytes))} without the plan</text>")
    if after:
        i = peak_step
        cx, cy = frame.x(i), frame.y(plan.predicted_peak_bytes)
        label = f"peak {format_bytes(plan.predicted_peak_bytes)}"  # where: in the table beside
        anchor = "end" if cx > (frame.left + plot_right) / 2 else "start"
        # above the marker, unless the budget line's label is there
        label_y = cy - 9 if cy - frame.y(step_budget) > 28 else cy + 19
        parts += [
            f'<circle class="peak" data-peak-bytes="{plan.predicted_peak_bytes}" data-step="{i}" cx="{_num(cx)}" '
            f'cy="{_num(cy)}" r="5" fill="white" stroke="#bf5700" stroke-width="2.5">'
            f"<title>{escape(label)} at step {i} ({escape(plan.peak_phase)} {escape(plan.peak_node)})</title></circle>",
            f'<text x="{_num(cx + (-9 if anchor == "end" else 9))}" y="{_num(label_y)}" text-anchor="{anchor}" '
            f'fill="#bf5700" font-weight="bold" {HALO}>{escape(label)}</text>',
        ]
    if not before and not after:
        parts.append(f'<text x="{(frame.left + plot_right) / 2}" y="{(frame.top + plot_bottom) / 2}" '
                     'text-anchor="middle" fill="#888">no live-bytes timeline recorded</text>')
    parts += _legend(frame)
    parts.append("</svg>")
    return "\n".join(parts)


def _legend(frame: Frame) -> list[str]:
    entries = (("before: every activation kept", "#555555", "4 3"), ("after: this plan (total)", "#1f3b73", ""),
               ("step budget", "#d1242f", "6 4"))
    parts, x = [], frame.left
    for text, colour, dash in entries:
        dash_attr = f' stroke-dasharray="{dash}"' if dash else ""
        parts.append(f'<line x1="{x}" y1="18" x2="{x + 24}" y2="18" stroke="{colour}" stroke-width="2"{dash_attr}/>')
        parts.append(f'<text x="{x + 30}" y="18" dominant-baseline="middle" fill="#222">{escape(text)}</text>')
        x += 40 + 7 * len(text)
    parts.append(f'<text x="{x}" y="18" dominant-baseline="middle" fill="#555">areas: what the plan holds, '
                 "by category (table)</text>")
    return parts


def _share(part: int, whole: int) -> str:
    return f"{part / whole:.0%}" if whole else "-"


def verdict_html(plan: Plan) -> str:
    """What the plan comes to, in words: fits or not, the status, the budget and reserve."""
    fits = plan.predicted_peak_bytes <= plan.step_budget_bytes
    head = "Fits." if fits else "Over the budget."
    budget = (f"Budget {format_bytes(plan.budget_bytes)}"
              + (f" ({plan.budget_source})" if plan.budget_source else "")
              + (f"; reserve {format_bytes(plan.reserve_bytes)}{reserve_parts(plan)} held outside the step"
                 if plan.reserve_bytes else "") + ".")
    return "\n".join([
        f'<p class="verdict {"fits" if fits else "over"}"><strong>{head}</strong> Predicted peak '
        f"{escape(format_bytes(plan.predicted_peak_bytes))} of the step budget "
        f"{escape(format_bytes(plan.step_budget_bytes))} ({_share(plan.predicted_peak_bytes, plan.step_budget_bytes)}); "
        f"{escape(format_bytes(plan.predicted_peak_before_bytes))} with every activation kept.</p>",
        f'<p class="status">Plan: {escape(status_words(plan.solver_status, plan.gap))}. '
        + (f"It adds about {escape(format_seconds(plan.total_added_time_s))} to a step (estimate)."
           if plan.total_added_time_s > 0 else "It adds no recomputation to the step.") + "</p>",
        f'<p class="budget-source">{escape(budget)}</p>',
        *([f'<p class="rewrites">Graph rewrites: {escape("; ".join(plan.graph_rewrites))}.</p>']
          if plan.graph_rewrites else []),
    ])


def _swatch(category: str) -> str:
    return f'<span class="swatch" style="background:{category_colour(category)}"></span>'


def peak_html(plan: Plan) -> str:
    """Beside the picture: what holds memory at the peak, by category and largest tensors."""
    total = sum(b for _, b in plan.peak_breakdown)
    rows = [f'<tr data-category="{_attr(c)}"><td>{_swatch(c)}{escape(category_words(c))}</td>'
            f'<td class="num">{escape(format_bytes(b))}</td><td class="num">{_share(b, total)}</td></tr>'
            for c, b in sorted(plan.peak_breakdown, key=lambda cb: (-cb[1], cb[0])) if b]
    where = f"{plan.peak_phase} node {plan.peak_node}" if plan.peak_node else "step"
    parts = ['<aside class="at-peak">',
             f"<h3>At the peak: {escape(format_bytes(total))} ({escape(where)})</h3>",
             '<table class="peak-categories"><tr><th>held by</th><th class="num">bytes</th><th class="num">share</th></tr>',
             *rows, "</table>"]
    if plan.peak_tensors:
        decisions = {d.name: d for d in plan.decisions}
        parts += ["<h3>Largest tensors live at the peak</h3>",
                  '<table class="peak-tensors"><tr><th>tensor</th><th class="num">bytes</th><th>what</th></tr>']
        for name, category, nbytes in plan.peak_tensors:
            d = decisions.get(name.removesuffix(" (backward)"))
            what = (f"{d.op.removesuffix('.default')} [{', '.join(map(str, d.shape))}], {d.label}" if d
                    else category_words(category, one=True))
            source = f' title="{_attr(d.source)}"' if d and d.source else ""  # the user's line, on hover
            parts.append(f'<tr data-category="{_attr(category)}" data-bytes="{nbytes}"><td>{_swatch(category)}'
                         f'{escape(name)}</td><td class="num">{escape(format_bytes(nbytes))}</td>'
                         f"<td{source}>{escape(what)}</td></tr>")
        parts.append("</table>")
    parts.append("</aside>")
    return "\n".join(parts)


_PAGE_STYLE = """
body { font-family: sans-serif; margin: 24px; color: #222; }
section { margin-bottom: 40px; }
h2 { margin-bottom: 4px; }
h3 { font-size: 14px; margin: 4px 0 6px 0; }
p { margin: 4px 0; max-width: 1300px; }
.verdict.fits strong { color: #1a7f37; }
.verdict.over strong { color: #d1242f; }
.row { display: flex; gap: 20px; align-items: flex-start; margin-top: 10px; }
.row svg { flex: 0 1 900px; min-width: 480px; }
aside { flex: 1 1 340px; font-size: 13px; }
table { border-collapse: collapse; margin-bottom: 14px; }
th, td { padding: 2px 8px; text-align: left; border-bottom: 1px solid #eee; vertical-align: top; }
th { font-weight: 600; color: #444; }
.num { text-align: right; white-space: nowrap; }
.swatch { display: inline-block; width: 11px; height: 11px; margin-right: 6px; border: 1px solid #777; }
.source { color: #666; font-family: monospace; font-size: 11px; }
.peak-tensors td:first-child, .peak-tensors td:last-child { white-space: nowrap; }
pre { font-size: 12px; background: #f6f8fa; padding: 12px; overflow-x: auto; }
svg { max-width: 100%; height: auto; border: 1px solid #ddd; }
"""


def to_html(plans: Sequence[Plan]) -> str:
    """A self-contained page (inline SVG, no scripts, nothing fetched), well-formed as XML too."""
    sections = [
        f'<section id="{_attr(p.graph_id)}">\n<h2>{escape(p.graph_id)}</h2>\n{verdict_html(p)}\n'
        f'<div class="row">\n{plan_svg(p)}\n{peak_html(p)}\n</div>\n'
        f"<pre>{escape(plan_text(p))}</pre>\n</section>"
        for p in plans
    ] or ["<p>No plans: no graph with a backward pass compiled yet.</p>"]
    return "\n".join([
        "<!DOCTYPE html>",
        '<html xmlns="http://www.w3.org/1999/xhtml" lang="en">',
        '<head><meta charset="utf-8"/><title>memcompile plans</title>'
        f"<style>{_PAGE_STYLE}</style></head>",
        "<body>",
        "<h1>memcompile plans</h1>",
        *sections,
        "</body>",
        "</html>",
    ]) + "\n"


# -- entry points --------------------------------------------------------------------------------

_RENDERERS = {"text": to_text, "json": to_json, "html": to_html}


def dump(obj: object, format: str = "text", path: str | Path | None = None) -> str:
    """Render the plans of `obj` (see plans_of) as text, JSON or HTML; also write to `path` if given."""
    if not isinstance(format, str) or format not in _RENDERERS:
        raise ValueError(f"format must be one of {FORMATS}, got {format!r}")
    if path is not None and not isinstance(path, (str, Path)):
        raise TypeError(f"path must be a str or pathlib.Path (or None), got {type(path).__name__}")
    rendered = _RENDERERS[format](plans_of(obj))
    if path is not None:
        Path(path).write_text(rendered, encoding="utf-8")
    return rendered


def _safe_file_stem(graph_id: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", graph_id) or "graph"


def write_dump_dir(plan: Plan, directory: str | None) -> tuple[Path, ...]:
    """Write <graph_id>.json and .html into `directory` (MEMCOMPILE_DUMP_DIR); nothing when it is unset.

    A failed write is logged, not raised: a debugging aid must not stop the training run.
    """
    if not directory:
        return ()
    folder = Path(directory)
    stem = _safe_file_stem(plan.graph_id)
    paths = (folder / f"{stem}.json", folder / f"{stem}.html")
    try:
        folder.mkdir(parents=True, exist_ok=True)
        paths[0].write_text(to_json([plan]), encoding="utf-8")
        paths[1].write_text(to_html([plan]), encoding="utf-8")
    except OSError as error:
        log.warning("MEMCOMPILE_DUMP_DIR: could not write the plan of %s: %s", plan.graph_id, error)
        return ()
    log.info("wrote the plan of %s to %s and %s", plan.graph_id, paths[0], paths[1])
    return paths
