"""The fusions memcompile refuses Inductor (passes/fusion_refusals.py), over hand-made facts:
no Inductor (its hooks read these facts off the scheduler: test_inductor_schedule_buffers)."""

from memcompile.passes import fusion_refusals as rules
from memcompile.passes.fusion_refusals import FusedResult

LARGE = rules.LIFETIME_FUSION_MIN_BYTES


def test_recomputations_fuse_only_within_the_distance_and_the_gap():
    assert not rules.horizontal_too_far_for_a_recomputation((10, 10), (10 + rules.RECOMPUTE_FUSION_DISTANCE, 14))
    assert rules.horizontal_too_far_for_a_recomputation((10, 10), (11, 10 + rules.RECOMPUTE_FUSION_DISTANCE + 1))
    assert rules.horizontal_too_far_for_a_recomputation((11, 15), (10, 10)), "either order"
    gap = rules.RECOMPUTE_VERTICAL_GAP
    assert not rules.vertical_too_far_for_a_recomputation((0, 3), (3 + gap, 3 + gap))
    assert rules.vertical_too_far_for_a_recomputation((0, 3), (4 + gap, 4 + gap))
    assert rules.vertical_too_far_for_a_recomputation((4 + gap, 4 + gap), (0, 3)), "either order"


def test_a_fusion_is_refused_where_a_large_early_result_dies_before_the_late_node():
    dies_before = FusedResult(LARGE, (3, 5), graph_output=False)
    assert rules.fusion_extends_a_lifetime([dies_before], [LARGE], late_order=6)
    assert not rules.fusion_extends_a_lifetime([dies_before], [LARGE], late_order=5), "read there: alive anyway"


def test_fusions_that_hold_nothing_large_longer_stand():
    dies_before = FusedResult(LARGE, (3,), graph_output=False)
    assert not rules.fusion_extends_a_lifetime([dies_before], [LARGE - 1], 6), "late allocates nothing large"
    assert not rules.fusion_extends_a_lifetime([dies_before], [], 6), "late's results die in the kernel"
    for early in (FusedResult(LARGE - 1, (3,), False), FusedResult(LARGE, (), False),
                  FusedResult(LARGE, (3,), graph_output=True), FusedResult(LARGE, (3, None), False)):
        assert not rules.fusion_extends_a_lifetime([early], [LARGE], 6), early


def test_the_early_results_are_read_only_where_the_late_node_allocates_something_large():
    def unread():
        raise AssertionError("read")
        yield

    assert not rules.fusion_extends_a_lifetime(unread(), [LARGE - 1], 6)
