"""Inductor's lowering: the compile memcompile hands its partitioned graphs to, and the lowering
and scheduling of a graph (no code generation) into its schedule as plain data."""

from __future__ import annotations

import copy
import dataclasses
import functools
from typing import Any, Callable, Sequence

import torch
import torch.fx as fx
from torch._inductor.compile_fx import compile_fx as _compile_fx
from torch._inductor.compile_fx import compile_fx_inner as _compile_fx_inner

from memcompile._torch_private.functorch import PartitionerBase, aot_settings, is_tangent
from memcompile._torch_private.inductor_hooks import (
    PLANNED_RULES, InductorRules, inductor_rules, mark_planned, on_each_schedule)
from memcompile._torch_private.scheduler_facts import schedule_facts

@dataclasses.dataclass(frozen=True)
class CompiledSchedule:
    """A graph's schedule as the compile that runs it built it (compile_with_inductor's `schedules`)."""

    is_backward: bool
    graph: fx.GraphModule  # after Inductor's post-grad passes: the graph it lowered
    schedule: Any  # memcompile.passes.inductor_schedule.InductorSchedule
    output_names: tuple[str | None, ...]  # the graph's outputs' names before those passes (they rename some)
    view_names: frozenset[str] = frozenset()  # its `view` nodes before the compile

    def as_checked(self) -> fx.GraphModule:
        """A copy of `graph` as the schedule check sees its copies: Inductor's compile turns every
        `view` into a `reshape` first (for layout changes) that the liveness would count as a
        copy; those it lowered as views are views again."""
        copied = fx.GraphModule(self.graph, copy.deepcopy(self.graph.graph))
        for node in copied.graph.find_nodes(op="call_function", target=torch.ops.aten.reshape.default):
            if node.name in self.view_names:
                node.target = torch.ops.aten.view.default
        return copied


def compile_with_inductor(
    gm: fx.GraphModule, example_inputs: Sequence[Any], partitioner: PartitionerBase,
    on_inference: Callable[[fx.GraphModule], None] | None = None,
    schedules: list[CompiledSchedule] | None = None, autograd_cache: bool = False,
    rules: InductorRules = PLANNED_RULES,
) -> Callable:
    """Stock Inductor (pre/post-grad passes, codegen) with our partitioner plugged in;
    `on_inference` sees an inference graph (AOTAutograd's, before codegen), which no
    partitioner does. `schedules` receives the forward's and backward's schedules as this
    compile built them (none for a graph Inductor's FX graph cache had: it lowers nothing).
    With `autograd_cache`, AOTAutograd's cache may serve the compiled graphs: then neither the
    partitioner nor `on_inference` runs (see aot_settings)."""
    expected: dict[int, tuple[bool, tuple[str | None, ...], frozenset[str]]] = {}

    def inner_compile(graph, inputs, **kwargs):
        if kwargs.get("is_inference"):
            if on_inference is not None:
                on_inference(graph)
        elif schedules is not None:
            outputs = graph.graph.find_nodes(op="output")[0].args[0]
            views = graph.graph.find_nodes(op="call_function", target=torch.ops.aten.view.default)
            expected[id(graph)] = (bool(kwargs.get("is_backward")),
                                   tuple(a.name if isinstance(a, fx.Node) else None for a in outputs),
                                   frozenset(n.name for n in views))
        return _compile_fx_inner(graph, inputs, **kwargs)

    def on_scheduled(graph) -> None:  # a GraphLowering: its schedule, where inner_compile expects it
        wanted = expected.pop(id(graph.module), None)
        if wanted is not None:
            schedules.append(CompiledSchedule(wanted[0], graph.module, _schedule_of(graph), wanted[1], wanted[2]))

    # the backward lowers with the forward (aot_settings): both inside the rules' scope
    with (on_each_schedule(on_scheduled if schedules is not None else None), aot_settings(autograd_cache),
          inductor_rules(rules)):
        return _compile_fx(gm, example_inputs, inner_compile=inner_compile,
                           config_patches={"custom_partitioner_fn": partitioner})


def inductor_post_grad_copy(gm: fx.GraphModule, is_inference: bool = False) -> fx.GraphModule:
    """A copy of `gm` after Inductor's post-grad passes: the graph its code generation lowers
    (compile_fx runs the same passes on the graphs we hand it; e.g. `mm + add` becomes one
    `addmm` at the add's position, which keeps the mm's inputs alive until then)."""
    from torch._guards import detect_fake_mode
    from torch._inductor.compile_fx import _recursive_post_grad_passes
    from torch._inductor.virtualized import V

    copied = fx.GraphModule(gm, copy.deepcopy(gm.graph))
    fake_mode = detect_fake_mode([n.meta.get("val") for n in copied.graph.nodes if n.op == "placeholder"])
    with torch.no_grad(), V.set_fake_mode(fake_mode):
        _recursive_post_grad_passes(copied, is_inference=is_inference)
    return copied


def inductor_schedule(gm: fx.GraphModule, is_backward: bool, rules: InductorRules = PLANNED_RULES):
    """Inductor's kernels for `gm` (a graph after its post-grad passes, see inductor_post_grad_copy)
    in the order its wrapper runs them, as plain data (memcompile.passes.inductor_schedule):
    lowering and scheduling (fusion, reordering for peak memory) under `rules`, no code generation."""
    from torch._guards import detect_fake_mode
    from torch._inductor.debug import DebugContext
    from torch._inductor.graph import GraphLowering
    from torch._inductor.virtualized import V

    example = [n.meta.get("val") for n in gm.graph.nodes if n.op == "placeholder"]
    fake_mode = detect_fake_mode(example)
    if rules.planned:
        mark_planned(rules, gm)  # and applying to this graph
    graph = GraphLowering(gm, example_inputs=example, is_backward=is_backward)
    if is_backward:
        # AOTAutograd donates saved tensors to the backward (bw_donated_idxs), which may write
        # over them; which ones is decided after partitioning: offer all but the tangents (the
        # liveness never lets a result take a parameter's or an input's storage).
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        graph.bw_donated_idxs = [i for i, n in enumerate(placeholders)
                                 if isinstance(n.meta.get("val"), torch.Tensor) and not is_tangent(n)]
    with DebugContext(), V.set_graph_handler(graph), V.set_fake_mode(fake_mode), inductor_rules(rules):
        graph.run(*example)
        graph.init_wrapper_code()
        graph._update_scheduler()
        return _schedule_of(graph)


def _schedule_of(graph):
    """The kernels of a lowered and scheduled GraphLowering (the current V.graph), as plain data:
    the facts are read here, what the wrapper allocates, frees and writes in place is decided in
    memcompile.passes.inductor_schedule."""
    from memcompile.passes.inductor_schedule import schedule_from_facts

    return schedule_from_facts(schedule_facts(graph))


@functools.lru_cache(maxsize=1)
def inductor_lowering_facts() -> tuple[frozenset, frozenset, frozenset]:
    """(ops Inductor lowers itself, ops it runs as fallback kernels, ops whose inputs it realizes)
    from torch._inductor.lowering's tables: what passes/fusion.py predicts materialization from."""
    from torch._inductor import lowering

    return (frozenset(k for k in lowering.lowerings if isinstance(k, torch._ops.OpOverload)),
            frozenset(lowering.fallbacks), frozenset(lowering.needs_realized_inputs))
