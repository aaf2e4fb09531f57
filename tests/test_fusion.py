"""passes/fusion.py: which tensors Inductor stores, on small graphs (plain facts and traced FX)."""

from __future__ import annotations

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from memcompile.passes.fusion import (
    EITHER,
    EXTERN,
    INLINED,
    INPUT,
    MATERIALIZED,
    OTHER,
    POINTWISE,
    REDUCTION,
    VIEW,
    FusionRules,
    OpFacts,
    predict_fusion,
)
from memcompile.passes.graph_facts import fusion_facts
from memcompile.passes.liveness import analyze_liveness


def _inputs(*names):
    return [OpFacts(n, INPUT) for n in names]


def test_single_use_pointwise_chain_is_inlined_into_its_reduction():
    ops = _inputs("x") + [
        OpFacts("a", POINTWISE, ("x",), constants=1),
        OpFacts("b", POINTWISE, ("a",)),
        OpFacts("s", REDUCTION, ("b",), is_output=True),
    ]
    p = predict_fusion(ops)
    assert [p.fate(n) for n in ("x", "a", "b", "s")] == [MATERIALIZED, INLINED, INLINED, MATERIALIZED]


def test_inputs_of_extern_kernels_and_graph_outputs_are_buffers():
    ops = _inputs("x", "w") + [
        OpFacts("a", POINTWISE, ("x",)),
        OpFacts("t", VIEW, ("a",)),  # a view between the body and the kernel does not hide it
        OpFacts("mm", EXTERN, ("t", "w"), realizes_inputs=True),
        OpFacts("out", POINTWISE, ("mm",), is_output=True),
    ]
    p = predict_fusion(ops)
    assert p.fate("a") == MATERIALIZED and p.fate("t") == MATERIALIZED
    assert p.fate("out") == MATERIALIZED and p.fate("mm") == MATERIALIZED


def test_view_of_an_output_realizes_its_base_and_views_of_bodies_are_inlined():
    ops = _inputs("x") + [
        OpFacts("a", POINTWISE, ("x",)),
        OpFacts("v", VIEW, ("a",), is_output=True),
        OpFacts("b", POINTWISE, ("x",)),
        OpFacts("w", VIEW, ("b",)),
        OpFacts("s", REDUCTION, ("w",), is_output=True),
    ]
    p = predict_fusion(ops)
    assert p.fate("a") == MATERIALIZED
    assert p.fate("b") == INLINED and p.fate("w") == INLINED


@pytest.mark.parametrize("heavy, cpu, fate", [(True, True, MATERIALIZED), (False, True, INLINED),
                                              (True, False, INLINED)])
def test_reused_body_with_a_heavy_op_is_stored_on_cpu(heavy, cpu, fate):
    ops = _inputs("x") + [
        OpFacts("e", POINTWISE, ("x",), heavy=heavy),
        OpFacts("s", REDUCTION, ("e",), is_output=True),
        OpFacts("d", POINTWISE, ("e", "s"), is_output=True),
    ]
    rules = FusionRules.for_device("cpu" if cpu else "cuda")
    assert predict_fusion(ops, rules).fate("e") == fate


@pytest.mark.parametrize("reads, fate", [(3, INLINED), (4, INLINED), (5, MATERIALIZED)])
def test_reused_body_is_stored_once_it_reads_more_than_the_reads_threshold(reads, fate):
    names = [f"x{i}" for i in range(reads)]
    ops = _inputs(*names) + [
        OpFacts("a", POINTWISE, tuple(names)),
        OpFacts("s1", REDUCTION, ("a",), is_output=True),
        OpFacts("s2", REDUCTION, ("a",), is_output=True),
    ]
    assert predict_fusion(ops).fate("a") == fate


def test_reads_accumulate_through_inlined_producers():
    # 13 inputs joined pairwise: each body reads few buffers, the last one reads all 13 (> 12).
    names = [f"x{i}" for i in range(13)]
    ops = _inputs(*names)
    prev = names[0]
    for i, n in enumerate(names[1:]):
        ops.append(OpFacts(f"a{i}", POINTWISE, (prev, n)))
        prev = f"a{i}"
    ops.append(OpFacts("s", REDUCTION, (prev,), is_output=True))
    p = predict_fusion(ops)
    assert p.fate("a0") == INLINED
    assert p.fate(prev) == MATERIALIZED


def test_ops_of_unknown_lowering_count_both_ways():
    ops = _inputs("x") + [
        OpFacts("c", OTHER, ("x",)),
        OpFacts("s", REDUCTION, ("c",), is_output=True),
        OpFacts("a", POINTWISE, ("x",)),
        OpFacts("k", OTHER, ("a",), is_output=True),  # a consumer that may realize its inputs
    ]
    p = predict_fusion(ops)
    assert p.fate("c") == EITHER and p.fate("a") == EITHER


def _traced(fn, *args):
    return make_fx(fn)(*args)


def test_facts_from_traced_graphs():
    def f(x, w):
        h = torch.tanh(x * 2 + 1)  # mul -> add -> tanh, one use each: inlined up to the mm input
        y = h @ w
        e = torch.exp(y)  # used twice, heavy: stored
        return (e / e.sum(-1, keepdim=True)).sum()

    gm = _traced(f, torch.randn(8, 16), torch.randn(16, 16))
    facts = {f.name: f for f in fusion_facts(gm)}
    p = predict_fusion(tuple(facts.values()))
    by_target = {}
    for n in gm.graph.nodes:
        by_target.setdefault(str(n.target), n.name)
    assert facts[by_target["aten.mm.default"]].kind == EXTERN
    assert p.fate(by_target["aten.mul.Tensor"]) == INLINED
    assert p.fate(by_target["aten.add.Tensor"]) == INLINED
    assert p.fate(by_target["aten.tanh.default"]) == MATERIALIZED  # the mm's input
    assert p.fate(by_target["aten.exp.default"]) == MATERIALIZED
    assert p.fate(by_target["aten.div.Tensor"]) == INLINED  # into the final sum


def test_inlined_bodies_hold_no_buffer_but_keep_their_inputs_alive():
    n = 256 * 1024

    def f(x, y):
        big = x * y  # 1 MiB of float32, inlined into `s`
        z = torch.full((n,), 3.0) * x  # allocated while `big`'s inputs are still needed
        return ((big + z).sum(),)

    x, y = torch.randn(n), torch.randn(n)
    gm = _traced(f, x, y)
    plain = analyze_liveness(gm, None, 1)
    fused = analyze_liveness(gm, None, 1, fuse_pointwise=True)
    inputs = 2 * n * 4
    # Every node a buffer: x, y, big (then x, y freed only at the end: they are inputs), ones, z...
    assert plain.peak_bytes >= inputs + 2 * n * 4
    # Fused: `big`, `ones * 3` and `big + z` are bodies of the one reduction kernel: inputs + scratch.
    assert fused.peak_bytes < inputs + n * 4
    assert fused.peak_bytes >= inputs


@pytest.mark.parametrize("transposed", [False, True])
def test_stored_result_takes_over_a_dying_input_read_at_the_same_element(transposed):
    n = 256

    def f(x, w, v):
        h = x @ v  # live across, so the step of `e` is the peak
        a = x @ w
        e = torch.exp(a.t() if transposed else a)  # stored: reused, heavy
        return ((e.sum() + (e * h).sum()),)

    x, w, v = torch.randn(n, n), torch.randn(n, n), torch.randn(n, n)
    gm = _traced(f, x, w, v)
    fused = analyze_liveness(gm, None, 1, fuse_pointwise=True)
    block = n * n * 4
    inputs = 3 * block
    # `e` written over `a` (Inductor's inplace_buffers): h + e; through a transpose it cannot be.
    expected_live = 3 * block if transposed else 2 * block
    assert fused.peak_bytes >= inputs + expected_live
    assert fused.peak_bytes < inputs + expected_live + block // 2


def test_a_dead_buffer_is_held_until_a_later_allocation_of_its_size_reuses_it():
    n = 256

    def f(x, w, v, u):
        p = x @ w
        q = p @ w
        s = p.sum() + q.sum()  # p and q die here
        c = x @ v  # the size and dtype of p and q: takes one of them over
        d = u @ u  # a different size: never a reuse
        return ((c * s).sum() + d.sum(),)

    x, w, v, u = torch.randn(n, n), torch.randn(n, n), torch.randn(n, n), torch.randn(n // 2, n // 2)
    gm = _traced(f, x, w, v, u)
    timeline = analyze_liveness(gm, None, 1, fuse_pointwise=True)
    block, inputs = n * n * 4, 3 * n * n * 4 + (n // 2) ** 2 * 4
    # between the death of p, q and the allocation of c, one of them stays allocated (not both)
    sums = [s for s in timeline.steps if s.node.startswith("add")]
    assert sums and all(inputs + block <= s.live_bytes < inputs + 2 * block for s in sums[:1])
    plain_pool = [s for s in analyze_liveness(gm, None, 1).steps if s.node.startswith("add")]
    assert plain_pool[0].live_bytes < inputs + block  # the FX interpreter frees them at once
