"""The examples under examples/ at small sizes: gradients and losses equal eager, peaks within the budget."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest
import torch

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
FAST = {"codegen": "aot_eager", "time_limit_s": 2.0}


def _example(name: str):
    sys.path.insert(0, str(EXAMPLES))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(EXAMPLES))


def _assert_all_close(got, expected):
    assert len(got) == len(expected)
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-6)


def _recomputes(plans) -> bool:
    return any(d.choice == "recompute" for p in plans for d in p.decisions)


def test_train_loop_with_adamw_reserve():
    r = _example("train_loop").run(steps=3, **FAST)
    _assert_all_close(r.compiled_first_grads, r.eager_first_grads)
    torch.testing.assert_close(torch.tensor(r.compiled_losses), torch.tensor(r.eager_losses), rtol=1e-5, atol=0)
    assert r.eager_peak_bytes > r.budget_bytes  # the budget binds: eager would not fit
    assert _recomputes(r.plans)
    # optimizer= (beside what a compile during the step allocates, a constant on the CPU)
    assert all(p.reserve_bytes - p.compile_scratch_bytes == p.optimizer_reserve_bytes == r.reserve_bytes > 0
               for p in r.plans)
    assert all(p.predicted_peak_bytes <= r.budget_bytes - p.reserve_bytes for p in r.plans)
    # Whole iterations (forward, backward, AdamW step) with the optimizer state live stay within the budget.
    assert len(r.compiled_peak_bytes) == 2
    assert max(r.compiled_peak_bytes) <= r.budget_bytes


@pytest.fixture(scope="module")
def per_block_result():
    torch._dynamo.reset()
    return _example("per_block").run(steps=4, **FAST)


def test_per_block_compilation_matches_eager_and_each_block_plan_fits(per_block_result):
    r = per_block_result
    _assert_all_close(r.compiled_grads, r.eager_grads)
    assert r.eager_peak_bytes > r.budget_bytes
    assert _recomputes(r.plans)
    assert all(p.budget_bytes == r.budget_bytes and p.predicted_peak_bytes <= p.step_budget_bytes for p in r.plans)


def test_per_block_step_peak_is_within_the_shared_budget(per_block_result):
    r = per_block_result
    assert r.predicted_step_peak_bytes <= r.budget_bytes
    assert max(r.step_peaks_bytes) <= r.predicted_step_peak_bytes  # the ledger's sum bounds the real step


def test_per_block_plans_settle_after_the_second_step(per_block_result):
    """Three compiled graphs (block 0, whose input needs no grad; blocks 1-3, one graph; the
    head): each compiled when first called, re-planned at most once for the whole step's plan
    in step 2, then nothing changes."""
    r = per_block_result
    assert r.compiles_per_step[0] == 3
    assert r.compiles_per_step[1] <= 3
    assert all(n == 0 for n in r.compiles_per_step[2:])
    # From step 3 on: the same plans, the same measured peak. Step 2 re-plans inside its measured
    # window; one CI run measured it 4,160 B below steps 3 and 4 (not reproduced in 6 reruns, cause
    # unknown): it is held to the budget, not to equality.
    later = r.step_peaks_bytes[1:]
    assert len(later) >= 2 and len(set(later)) == 1
    assert r.step_peaks_bytes[0] <= r.budget_bytes


def test_per_block_below_the_least_joint_plan_raises_the_typed_error_and_its_minimum_fits():
    """A budget no combination of plans fits: the typed error before the first step runs over,
    naming the smallest budget of the blocks seen so far (each at its least peak; a later block
    may need more, and a run at that budget then names a larger one, or the whole step's floor);
    compiling at the last budget named then fits."""
    import memcompile
    per_block = _example("per_block")
    torch._dynamo.reset()
    with pytest.raises(memcompile.InfeasibleBudgetError) as info:
        per_block.run(budget_fraction=0.6, steps=2, **FAST)
    need = info.value.min_feasible_bytes
    assert need > info.value.budget_bytes
    for _round in range(6):  # the example's 4 blocks and head
        torch._dynamo.reset()
        try:
            r = per_block.run(budget_bytes=need, steps=3, **FAST)
            break
        except memcompile.InfeasibleBudgetError as error:
            # a later block's floor, or (once every block has been seen) the whole step's: the
            # regions' least peaks found within the solver's time limit may differ between runs
            assert error.min_feasible_bytes > need
            need = error.min_feasible_bytes
    else:
        raise AssertionError(f"no run at a named budget fitted (last {need})")
    assert r.budget_bytes == need
    assert max(r.step_peaks_bytes) <= r.predicted_step_peak_bytes <= r.budget_bytes


def test_hugging_face_trainer_compile_for_trainer_reserves_the_trainers_adamw_state():
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    r = _example("hf_trainer").run(steps=2, **FAST)
    _assert_all_close(r.compiled.first_grads, r.eager.first_grads)
    torch.testing.assert_close(torch.tensor(r.compiled.losses), torch.tensor(r.eager.losses), rtol=1e-5, atol=0)
    state = r.compiled.optimizer_state_bytes
    assert state > 0
    # the callback counted the Trainer's optimizer (created inside train()) before anything compiled
    assert all(p.optimizer_reserve_bytes == p.reserve_bytes - p.compile_scratch_bytes == state for p in r.plans)
    assert all("AdamW" in p.optimizer_source for p in r.plans)
    assert max(r.eager.step_peaks) > r.budget_bytes - state  # the step budget binds
    assert _recomputes(r.plans)
    assert max(r.compiled.step_peaks) + state <= r.budget_bytes


def test_hugging_face_trainer_tiny_llama_by_name():
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    r = _example("hf_trainer").run_by_name(steps=2, **FAST)
    _assert_all_close(r.compiled.first_grads, r.eager.first_grads)
    torch.testing.assert_close(torch.tensor(r.compiled.losses), torch.tensor(r.eager.losses), rtol=1e-5, atol=0)
    assert len(r.compiled.losses) == 2
    assert max(r.eager.step_peaks) > r.budget_bytes
    assert _recomputes(r.plans)
    assert max(r.compiled.step_peaks) <= r.budget_bytes


def test_trainer_refuses_the_backend_by_name_hence_the_example_compiles_the_model_itself(tmp_path):
    """README/hf_trainer.py say accelerate rejects torch_compile_backend="memcompile"; when it
    stops rejecting it, this fails and the docs should recommend the argument instead."""
    pytest.importorskip("accelerate")
    transformers = pytest.importorskip("transformers")
    model = _example("hf_trainer").tiny_llama()
    args = transformers.TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[],
                                          torch_compile_backend="memcompile")
    with pytest.raises(ValueError, match="not a valid DynamoBackend"):
        transformers.Trainer(model=model, args=args)
