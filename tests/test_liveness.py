"""Liveness of the rewritten graphs (random ops: tests/test_rng.py)."""

from __future__ import annotations

import torch

import memcompile
from memcompile import _torch_private as tp
from memcompile.passes.liveness import OP_SCRATCH_BYTES, analyze_liveness


def _graphs(fn, *inputs):
    """The (forward, backward) graphs AOTAutograd makes for fn, as memcompile partitions them."""
    captured = {}
    backend = memcompile.budget("10GB", codegen="aot_eager")
    from memcompile import planner

    original = planner.apply_plan

    def spy(*args, **kwargs):
        fw, bw = original(*args, **kwargs)
        captured["graphs"] = (fw, bw)
        return fw, bw

    planner.apply_plan = spy
    try:
        torch.compile(fn, backend=backend)(*inputs).backward()
    finally:
        planner.apply_plan = original
    return captured["graphs"], backend.plans[0]


def test_views_are_counted_once_and_grads_live_to_the_end():
    w = torch.randn(256, 256, requires_grad=True)  # 256 KiB

    def f(w):
        t = w.t()  # a view: no new storage
        return (t * 2).sum()

    (fw, bw), plan = _graphs(f, w)
    timeline = analyze_liveness(fw, bw, 1)
    mib = 256 * 1024
    # Static: w. Forward peak: w + (t*2). Backward: w + grad of w (+ scalars).
    assert timeline.static_bytes == mib
    assert timeline.peak_bytes < 3 * mib + OP_SCRATCH_BYTES + 64
    assert timeline.peak_bytes >= 2 * mib
    assert plan.predicted_peak_bytes == timeline.peak_bytes
    assert timeline.steps[-1].live_bytes >= 2 * mib  # gradient held to the end of the step


def test_fused_pointwise_chains_hold_no_buffer():
    x = torch.randn(512, 128, requires_grad=True)

    def f(x):
        return (torch.tanh(x * 3 + 1) * 2).exp().sum()

    (fw, bw), _ = _graphs(f, x)
    def forward_peak(timeline):
        return max(s.live_bytes for s in timeline.steps if s.phase == "forward")

    plain = forward_peak(analyze_liveness(fw, bw, 1))
    fused = forward_peak(analyze_liveness(fw, bw, 1, fuse_pointwise=True))
    assert fused < plain


def test_a_scatter_into_a_dying_temporary_takes_its_buffer_as_inductors_copy_does():
    """index_put(acc, ...) is lowered as a copy of acc written into: where acc dies there, the
    copy takes acc's buffer (an embedding's gradient accumulated into a tied head's). The
    graph-order count with scatters in place holds one of the two, as Inductor's schedule does."""
    from memcompile.planner import predicted_liveness

    w = torch.randn(1024, 256, requires_grad=True)  # 1 MiB
    idx = torch.randint(0, 1024, (64,))
    rows = torch.randn(64, 256)

    def f(w, idx, rows):
        acc = w * 2  # a temporary that dies at the index_put
        return torch.index_put(acc, (idx,), rows, accumulate=True).sum()

    (fw, bw), _ = _graphs(f, w, idx, rows)
    mib = 1024 * 256 * 4

    def forward_peak(timeline):
        return max(s.live_bytes for s in timeline.steps if s.phase == "forward")

    apart = forward_peak(analyze_liveness(fw, bw, 1))
    in_place = forward_peak(analyze_liveness(fw, bw, 1, scatters_in_place=True))
    assert apart - in_place == mib
    scheduled = forward_peak(predicted_liveness(fw, bw, 1, tp.PLANNED_RULES))
    assert abs(scheduled - in_place) < mib // 8
