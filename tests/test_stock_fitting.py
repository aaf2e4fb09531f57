"""Which of PyTorch's partitions is checked, and which is taken (planner.StockPartitions.fitting):
partition peaks do not fall with the fraction, so where the smallest fraction is a little over the
budget, the partition with the least graph-order count is checked too."""

from __future__ import annotations

import types

import copy

import pytest
import torch
from hypothesis import Phase, given, settings, strategies as st

import memcompile
from memcompile import _torch_private as tp, planner
from tests.models import WithLoss, build


def _partitions(checked: dict[float, int], counted: dict[float, int], held: dict[float, int] | None = None
                ) -> tuple[planner.StockPartitions, list[float]]:
    """StockPartitions whose partitions' checks and counts (and what each holds as its forward
    ends, where given) are these numbers (no graphs): and the list of fractions it lowers to
    check, in order."""
    lowered: list[float] = []
    stock = planner.StockPartitions(joint=None, joint_inputs=None, num_fwd_outputs=1,
                                    static_lifetime_input_indices=None, profile=None, forward_names=set())
    stock._partitions.update({f: (None, None, 0.0) for f in checked})
    stock._counts.update(counted)
    stock._held_at_forward_end.update(held or {})

    def make(fraction: float, as_stock: bool = False):
        lowered.append(("stock", fraction) if as_stock else fraction)  # (under Inductor's own rules)
        solution = planner.StockSolution(fraction, 0.0, 0, ())
        return planner._Attempt(solution, None, None, types.SimpleNamespace(peak_bytes=checked[fraction]),
                                stock_rules=as_stock)

    stock._make = make
    return stock, lowered


# measured (B): the GPT style file, 12 layers, 4 x 512, chunked head; Llama small (hf_models)
GPT = ({1.0: 2_328_965_136, 0.8: 1_910_777_872, 0.6: 2_215_393_812, 0.4: 2_304_629_268},
       {1.0: 2_455_189_516, 0.8: 2_002_397_196, 0.6: 2_213_812_752, 0.4: 2_296_740_368})
LLAMA = ({1.0: 18_035_272, 0.8: 15_581_768, 0.6: 17_187_400, 0.4: 14_244_936},
         {1.0: 25_387_620, 0.8: 22_147_684, 0.6: 19_315_812, 0.4: 22_113_356})


def test_where_the_smallest_fraction_is_a_little_over_the_least_count_is_checked():
    # 0.4 is over 1.92 GB by 20%; 0.8, counted least, fits at 1.91 GB
    stock, lowered = _partitions(*GPT)
    chosen = stock.fitting(1_922_533_691)
    assert chosen.solution.fraction == 0.8 and lowered == [0.4, 0.8]


def test_where_the_smallest_fraction_fits_the_larger_ones_are_bisected():
    stock, lowered = _partitions(*LLAMA)  # 0.4 checks at 14.2 MB
    chosen = stock.fitting(15_000_000)
    assert chosen.solution.fraction == 0.4 and lowered[0] == 0.4 and len(lowered) <= 3


def test_far_below_every_partition_one_check_is_spent():
    stock, lowered = _partitions(*GPT)
    assert stock.fitting(1_478_872_070) is None  # 0.5x plain's peak: 0.4 checks 56% over
    assert lowered == [0.4]


def test_a_larger_fraction_is_not_checked_where_its_scaled_count_is_well_over():
    checked = {1.0: 200, 0.8: 130, 0.6: 118, 0.4: 140}  # 0.4 a little over 135
    counted = {1.0: 400, 0.8: 150, 0.6: 125, 0.4: 150}  # 1.0: 400 x 118/125 = 378, far over
    stock, lowered = _partitions(checked, counted)
    assert stock.fitting(135).solution.fraction == 0.8
    assert lowered == [0.4, 0.6, 0.8]


# Per fraction a checked peak and a graph-order count (the check times 0.5-1.8), and a budget.
_CHECKS_COUNTS = st.tuples(st.lists(st.integers(50, 400), min_size=4, max_size=4),
                           st.lists(st.floats(0.5, 1.8), min_size=4, max_size=4)).map(
    lambda drawn: (dict(zip(planner.STOCK_FRACTIONS, drawn[0])),
                   {f: int(p * r) for f, p, r in zip(planner.STOCK_FRACTIONS, *drawn)}))


@settings(max_examples=200, deadline=None)
@given(_CHECKS_COUNTS, st.integers(40, 420))
def test_what_it_takes_fits_and_each_partition_is_checked_once(checks_counts, budget):
    fractions = planner.STOCK_FRACTIONS
    checked, counted = checks_counts
    stock, lowered = _partitions(checked, counted)
    chosen = stock.fitting(budget)
    assert lowered[0] == fractions[-1] and len(lowered) == len(set(lowered))
    if checked[fractions[-1]] > budget * (1 + planner._SMALLEST_CHECK_GAP):
        assert chosen is None and lowered == [fractions[-1]]
    if chosen is None:
        assert all(checked[f] > budget for f in lowered)
        return
    assert chosen.timeline.peak_bytes <= budget


# With the partitions made and counted already (no partition within the budget on its count), the
# default partition is checked first only where its count is near the budget, then the least count.

def test_counted_first_far_below_checks_only_the_least_count():
    stock, lowered = _partitions(*GPT)
    assert stock.fitting(1_478_872_070, counted_first=True) is None  # 0.5x plain's peak: below the floor
    assert lowered == [0.8]  # the default's count is 66% over: not checked


def test_counted_first_checks_the_default_where_its_count_is_near():
    stock, lowered = _partitions(*GPT)
    chosen = stock.fitting(1_922_533_691, counted_first=True)  # 0.65x plain's peak
    assert chosen.solution.fraction == 0.8 and lowered == [("stock", 1.0), 0.8]
    stock, lowered = _partitions(*LLAMA)  # counted 41% over its check: fits where its count does not
    chosen = stock.fitting(19_000_000, counted_first=True)
    assert chosen.solution.fraction == 1.0 and chosen.stock_rules and lowered == [("stock", 1.0)]


def test_each_budget_is_fitted_once():
    stock, lowered = _partitions(*GPT)
    first = stock.fitting(1_922_533_691, counted_first=True)
    assert stock.fitting(1_922_533_691) is first and lowered == [("stock", 1.0), 0.8]


def test_the_least_partition_peak_is_estimated_from_what_was_checked():
    stock, lowered = _partitions(*GPT)
    assert stock.least_peak_at_least() == 0  # nothing checked: not known
    stock.fitting(1_478_872_070, counted_first=True)  # 0.8 checked: 1.91 GB
    estimate = stock.least_peak_at_least()
    scale = GPT[0][0.8] / GPT[1][0.8]
    assert estimate == min(GPT[0][0.8], *(int(GPT[1][f] * scale / (1 + planner._PARTITION_ESTIMATE_SLACK))
                                          for f in (1.0, 0.6, 0.4)))
    assert 0 < estimate <= min(GPT[0].values())  # under every check of this graph


def test_the_least_peak_partition_checks_only_those_that_may_be_lower():
    stock, lowered = _partitions(*GPT)
    assert stock.least_peak_partition(below=10**12).solution.fraction == 0.4 and lowered == [0.4]  # none checked
    stock, lowered = _partitions(*GPT)
    stock.fitting(1_478_872_070, counted_first=True)
    # below the 0.8 partition's 1.91 GB only what its scale puts 20% under it is checked
    least = stock.least_peak_partition(below=1_700_000_000)
    scale = GPT[0][0.8] / GPT[1][0.8]
    expected = [0.8] + [f for f in (1.0, 0.6, 0.4)
                        if GPT[1][f] * scale / (1 + planner._PARTITION_ESTIMATE_SLACK) < 1_700_000_000]
    assert lowered == expected and least.solution.fraction == 0.8


def test_the_default_partition_checked_as_plain_inductor_is_not_lowered_again_for_the_least_peak():
    # the default partition's count within 45% of the budget: checked under Inductor's own rules
    checked = {1.0: 120, 0.8: 150, 0.6: 170, 0.4: 180}
    counted = {1.0: 130, 0.8: 140, 0.6: 300, 0.4: 320}
    stock, lowered = _partitions(checked, counted)
    assert stock.fitting(100, counted_first=True) is None
    assert lowered == [("stock", 1.0), 1.0]  # then the least count, which is 1.0's too, under our rules
    stock, lowered = _partitions(checked, {1.0: 130, 0.8: 125, 0.6: 300, 0.4: 320})
    assert stock.fitting(100, counted_first=True) is None and lowered == [("stock", 1.0), 0.8]
    least = stock.least_peak_partition(below=10**6)
    # 1.0's count, scaled as its own check scaled it and 20% under, is below every check (100 < 120):
    # it would be lowered again under our rules; 0.6 and 0.4 (231 and 246) are not below 120
    assert lowered == [("stock", 1.0), 0.8]
    assert least.solution.fraction == 1.0 and least.stock_rules and least.timeline.peak_bytes == 120


@settings(max_examples=200, deadline=None)
@given(_CHECKS_COUNTS, st.integers(40, 420))
def test_counted_first_takes_what_fits_and_checks_each_once(checks_counts, budget):
    fractions = planner.STOCK_FRACTIONS
    checked, counted = checks_counts
    stock, lowered = _partitions(checked, counted)
    chosen = stock.fitting(budget, counted_first=True)
    if min(counted.values()) > budget * (1 + planner._COUNT_OVER_CHECK):
        # every count over the budget by more than a count was seen over its check: none lowered
        assert chosen is None and lowered == []
        return
    # each check once: the default partition at most once under Inductor's rules, once under ours
    assert len(lowered) == len(set(lowered)) and len(lowered) <= len(fractions) + 1
    fractions_lowered = [f[1] if isinstance(f, tuple) else f for f in lowered]
    if chosen is None:
        assert lowered and all(checked[f] > budget for f in fractions_lowered)
    else:
        assert chosen.timeline.peak_bytes <= budget and chosen.solution.fraction in fractions_lowered
        # nothing larger that was checked fits: it would have been taken
        assert not any(f > chosen.solution.fraction and checked[f] <= budget for f in fractions_lowered)
    if counted[1.0] > budget * (1 + planner._COUNT_OVER_CHECK):
        # the default partition is not checked first (unless it counts least)
        assert lowered[0] == min(counted, key=lambda f: (counted[f], -f))
    else:
        assert lowered[0] == ("stock", 1.0)  # as plain Inductor compiles it
    assert stock.least_peak_at_least() <= min(checked[f] for f in fractions_lowered)


def test_partitions_counted_far_over_the_budget_are_not_lowered():
    # The GPT style file's chunked-head graph (12 layers, 4 x 512) at a budget near its floor: 1.0,
    # 0.8 and 0.6 hold more than the budget as their forwards end; 0.4, within it there, counts 1.55x
    # the budget, more than any count was seen over its check (its check: 2.31 GB).
    checked = {1.0: 2_500_000_000, 0.8: 2_050_000_000, 0.6: 2_250_000_000, 0.4: 2_309_000_000}
    counted = {1.0: 2_455_189_516, 0.8: 2_002_397_196, 0.6: 2_213_812_752, 0.4: 2_296_740_368}
    held = {1.0: 2_294_364_172, 0.8: 1_841_571_852, 0.6: 1_604_069_388, 0.4: 1_402_742_796}
    stock, lowered = _partitions(checked, counted, held)
    assert stock.fitting(1_478_872_070, counted_first=True) is None and lowered == []
    assert stock.least_peak_at_least() == held[0.4]
    # within that factor of the budget, the least count is checked as before
    stock, lowered = _partitions(checked, counted, held)
    assert stock.fitting(1_600_000_000, counted_first=True) is None and lowered == [0.4]


def test_a_partition_checked_at_another_budget_is_taken_where_it_fits():
    checked = {1.0: 2_328_965_136, 0.8: 1_910_777_872, 0.6: 1_900_000_000, 0.4: 2_304_629_268}
    counted = {1.0: 2_455_189_516, 0.8: 2_002_397_196, 0.6: 1_990_000_000, 0.4: 2_296_740_368}
    stock, lowered = _partitions(checked, counted)
    stock._made_at(0.8)  # checked at some earlier budget
    # 0.6 counts least and fits; 0.8, larger, checked already and within the budget, is taken
    assert stock.fitting(1_950_000_000, counted_first=True).solution.fraction == 0.8


def test_where_the_least_count_checks_over_a_larger_fraction_estimated_within_is_checked():
    # As on the Llama (24 layers, 2 x 512, head whole): 0.4, the least count, checks just over the
    # budget, while 0.8 (a larger count) checks within it; 0.6's estimate is within too, but 0.8,
    # the faster, is checked first and taken. The default partition's estimate is over: not lowered
    # again beyond its check as plain Inductor compiles it.
    checked = {1.0: 1300, 0.8: 1110, 0.6: 1140, 0.4: 1127}
    counted = {1.0: 1500, 0.8: 1200, 0.6: 1180, 0.4: 1150}
    stock, lowered = _partitions(checked, counted)
    chosen = stock.fitting(1113, counted_first=True)
    assert chosen.solution.fraction == 0.8
    assert lowered == [("stock", 1.0), 0.4, 0.8]
    # far below (every estimate over): the least count's check is the only one
    stock, lowered = _partitions(checked, counted)
    assert stock.fitting(800, counted_first=True) is None
    assert lowered == [0.4]


# What the GPT style file's partitions (12 layers, 4 x 512, chunked head and MLPs) held as their
# forward ended (B), within 8 B of each check's forward end.
GPT_CHUNKED = ({1.0: 1_728_219_152, 0.8: 1_593_107_472, 0.6: 1_650_000_000, 0.4: 1_700_000_000},
               {1.0: 1_760_000_000, 0.8: 1_640_000_000, 0.6: 1_690_000_000, 0.4: 1_730_000_000},
               {1.0: 1_690_384_396, 0.8: 1_539_581_964, 0.6: 1_600_000_000, 0.4: 1_640_000_000})


def test_a_partition_whose_forward_ends_over_the_budget_is_not_lowered():
    stock, lowered = _partitions(*GPT_CHUNKED)
    assert stock.fitting(1_478_872_070, counted_first=True) is None and lowered == []
    assert stock.least_peak_at_least() == GPT_CHUNKED[2][0.8]  # the least any of them can peak at
    stock, lowered = _partitions(*GPT_CHUNKED)
    assert stock.fitting(1_478_872_070) is None and lowered == []
    # within the budget on what it holds: lowered and taken where its check fits
    stock, lowered = _partitions(*GPT_CHUNKED)
    assert stock.fitting(1_600_000_000, counted_first=True).solution.fraction == 0.8 and lowered == [0.8]
    # for the least peak, none is lowered that holds as much as the plan to beat
    stock, lowered = _partitions(*GPT_CHUNKED)
    assert stock.least_peak_partition(below=1_539_581_964) is None and lowered == []


@settings(max_examples=200, deadline=None)
@given(_CHECKS_COUNTS, st.lists(st.floats(0.3, 1.0), min_size=4, max_size=4), st.integers(40, 420),
       st.booleans())
def test_what_a_partition_holds_as_its_forward_ends_only_spares_checks(checks_counts, held_share, budget,
                                                                        counted_first):
    """Where what each partition holds as its forward ends is known (at most its check), the
    partitions it puts over the budget are not lowered, each partition is lowered at most once,
    what is taken fits, and one is taken wherever the search without it took one. (A check it
    spares can be the one whose scale put another partition's estimate within the budget, as in
    test_a_spared_check_still_scales_the_estimates.)"""
    checked, counted = checks_counts
    held = {f: int(checked[f] * share) for f, share in zip(planner.STOCK_FRACTIONS, held_share)}
    stock, lowered = _partitions(checked, counted, held)
    chosen = stock.fitting(budget, counted_first=counted_first)
    fractions_lowered = [f[1] if isinstance(f, tuple) else f for f in lowered]
    assert not any(held[f] > budget for f in fractions_lowered)
    assert len(lowered) == len(set(lowered))
    if chosen is not None:
        assert chosen.timeline.peak_bytes <= budget
    least = stock.least_peak_at_least()
    assert least <= min((checked[f] for f in fractions_lowered), default=least)
    assert least >= min(held.values())  # known for every partition: never "not known"
    plain, _ = _partitions(checked, counted)
    if plain.fitting(budget, counted_first=counted_first) is not None:
        assert chosen is not None  # the only partitions it rules out are over the budget


def test_a_spared_check_still_scales_the_estimates():
    # Without the forward-end bound the default partition is checked (51, over), its scale puts
    # 0.8's estimate within the budget, and 0.8 fits. With 1.0 ruled out on what it holds (51),
    # 0.6's check alone (51 on a count of 25) would put 0.8's at 85: what 1.0 holds scales it.
    checked = {1.0: 51, 0.8: 50, 0.6: 51, 0.4: 50}
    counted = {1.0: 51, 0.8: 50, 0.6: 25, 0.4: 50}
    held = {1.0: 51, 0.8: 40, 0.6: 40, 0.4: 40}
    stock, lowered = _partitions(checked, counted, held)
    chosen = stock.fitting(50, counted_first=True)
    assert chosen is not None and chosen.solution.fraction == 0.8
    assert 1.0 not in lowered and ("stock", 1.0) not in lowered


@pytest.mark.inductor  # the check lowers and schedules with Inductor
@settings(max_examples=6, deadline=None, phases=[Phase.explicit, Phase.reuse, Phase.generate])
@given(arch=st.sampled_from(["mlp", "convbn", "attention", "multi_output"]), size=st.sampled_from([8, 16, 32]),
       depth=st.integers(1, 3), batch=st.integers(2, 16), dtype=st.sampled_from([torch.float32, torch.float64]),
       fraction=st.sampled_from(planner.STOCK_FRACTIONS))
def test_no_schedule_of_a_partition_peaks_below_what_its_forward_ends_holding(arch, size, depth, batch, dtype,
                                                                              fraction):
    """The part of a partition's graph-order count that rules it out without a check (its inputs,
    saved tensors and outputs at the forward's end) is at most what its check on Inductor's schedule
    holds as that schedule's forward ends (convolutions in float64: half of it)."""
    model, x = build(arch, size, depth, batch, dtype)
    seen = []

    def spy(joint, joint_inputs, **kwargs):
        seen.append((copy.deepcopy(joint), joint_inputs, kwargs["num_fwd_outputs"]))
        raise memcompile.InfeasibleBudgetError("seen", budget_bytes=1, min_feasible_bytes=2)

    torch.compiler.reset()
    with pytest.MonkeyPatch.context() as patch, pytest.raises(memcompile.InfeasibleBudgetError):
        patch.setattr(planner, "_plan_joint_graph", spy)
        torch.compile(WithLoss(model), backend=memcompile.budget(10**12, codegen="aot_eager"))(x).backward()
    joint, joint_inputs, num_fwd_outputs = seen[0]
    fw, bw = tp.stock_partition(tp.prepare_joint_graph(joint), joint_inputs, memory_budget=fraction,
                                num_fwd_outputs=num_fwd_outputs)
    held = planner._graph_order_count(fw, bw, num_fwd_outputs, planner.EXACT, 0).held_as_forward_ends()
    check = planner.predicted_liveness(fw, bw, num_fwd_outputs, tp.PLANNED_RULES)
    assert 0 < held <= check.held_as_forward_ends() <= check.peak_bytes
