"""Which of PyTorch's partitions is checked, and which is taken (planner.StockPartitions.fitting):
partition peaks do not fall with the fraction, so the least graph-order count is checked first."""

from __future__ import annotations

import types

from hypothesis import given, settings, strategies as st

from memcompile import planner


def _partitions(checked: dict[float, int], counted: dict[float, int]) -> tuple[planner.StockPartitions, list[float]]:
    """StockPartitions whose partitions' checks and counts are these numbers (no graphs): and the
    list of fractions it lowers to check, in order."""
    lowered: list[float] = []
    stock = planner.StockPartitions(joint=None, joint_inputs=None, num_fwd_outputs=1,
                                    static_lifetime_input_indices=None, profile=None, forward_names=set())
    stock._partitions.update({f: (None, None, 0.0) for f in checked})
    stock._counts.update(counted)

    def make(fraction: float):
        lowered.append(fraction)
        solution = planner.StockSolution(fraction, 0.0, 0, ())
        return planner._Attempt(solution, None, None, types.SimpleNamespace(peak_bytes=checked[fraction]))

    stock._make = make
    return stock, lowered


# measured (B): the GPT style file, 12 layers, 4 x 512, chunked head; Llama small (hf_models)
GPT = ({1.0: 2_328_965_136, 0.8: 1_910_777_872, 0.6: 2_215_393_812, 0.4: 2_304_629_268},
       {1.0: 2_455_189_516, 0.8: 2_002_397_196, 0.6: 2_213_812_752, 0.4: 2_296_740_368})
LLAMA = ({1.0: 18_035_272, 0.8: 15_581_768, 0.6: 17_187_400, 0.4: 14_244_936},
         {1.0: 25_387_620, 0.8: 22_147_684, 0.6: 19_315_812, 0.4: 22_113_356})


def test_the_partition_with_the_least_count_is_checked_first():
    # 0.4, checked first before, is over 1.92 GB; 0.8 fits at 1.91 GB: one check finds it
    stock, lowered = _partitions(*GPT)
    chosen = stock.fitting(1_922_533_691)
    assert chosen.solution.fraction == 0.8 and lowered == [0.8]


def test_where_the_least_count_does_not_fit_the_smallest_fraction_is_checked_too():
    # Llama small: 0.6 has the least count but checks at 17.2 MB; 0.4 checks at 14.2 MB
    stock, lowered = _partitions(*LLAMA)
    chosen = stock.fitting(15_000_000)
    assert chosen.solution.fraction == 0.4 and lowered[:2] == [0.6, 0.4]
    # 0.8 (22.1 MB counted, scaled as 0.4's check scaled its count: 14.3 MB) is checked: over
    assert lowered == [0.6, 0.4, 0.8]


def test_at_a_tight_budget_at_most_two_partitions_are_checked():
    for checked, counted in (GPT, LLAMA):
        stock, lowered = _partitions(checked, counted)
        assert stock.fitting(min(checked.values()) - 1) is None
        assert 1 <= len(lowered) <= 2


def test_far_below_every_partition_one_check_is_spent():
    stock, lowered = _partitions(*GPT)
    assert stock.fitting(1_478_872_070) is None  # 0.5x plain's peak: 0.8 checks 29% over
    assert lowered == [0.8]


def test_a_larger_fraction_is_not_checked_where_its_scaled_count_is_well_over():
    checked = {1.0: 200, 0.8: 150, 0.4: 100}
    counted = {1.0: 400, 0.8: 160, 0.4: 110}  # 1.0: 400 x 100/110 = 364, far over 120
    stock, lowered = _partitions(checked, counted)
    assert stock.fitting(120).solution.fraction == 0.4
    assert 1.0 not in lowered


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(50, 400), min_size=4, max_size=4), st.lists(st.floats(0.5, 1.8), min_size=4, max_size=4),
       st.integers(40, 420))
def test_what_it_takes_fits_and_nothing_it_checked_and_passed_by_was_larger_and_fitting(peaks, ratios, budget):
    fractions = planner.STOCK_FRACTIONS
    checked = dict(zip(fractions, peaks))
    counted = {f: int(p * r) for f, p, r in zip(fractions, peaks, ratios)}
    stock, lowered = _partitions(checked, counted)
    chosen = stock.fitting(budget)
    if chosen is None:
        # none checked fits; the least count and the smallest fraction were both checked
        assert all(checked[f] > budget for f in lowered)
        least = min(fractions, key=lambda f: (counted[f], -f))
        assert least in lowered
        far_over = checked[least] > budget * (1 + planner._SMALLEST_CHECK_GAP)
        assert (fractions[-1] in lowered) == (not far_over or least == fractions[-1])
        return
    assert chosen.timeline.peak_bytes <= budget
    taken = chosen.solution.fraction
    assert not any(f > taken and checked[f] <= budget for f in lowered)  # the largest fitting one it saw
    assert len(lowered) == len(set(lowered))  # each lowered once
