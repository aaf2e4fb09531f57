"""benchmarks/gpu_check.py, the prepared device run, kept working between CUDA runs.

Its CPU smoke mode runs in a subprocess (tiny GPT-2 with one block, FX interpreter, memcompile
without its loss-head and MLP rewrites, two worker processes: ~35 s on 2 cores at load 5): the rows
it writes carry every field the table reads, every memcompile row honours its budget and its
prediction as memcompile.measure_peak measures, and a rerun from those rows runs nothing. The
schedule, its time guard, the order of the CUDA rows and the max-batch arithmetic are checked
without compiling anything."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")
BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

import gpu_check  # noqa: E402
import gpu_table  # noqa: E402
from gpu_check import ROWS, QUICK, SMOKE, Row, Schedule, estimate_batch, next_batch, simulate  # noqa: E402

FIELDS = ("id", "group", "model", "dtype", "name", "kind", "status", "batch", "peak", "start_bytes", "step_s",
          "baseline_step_s", "step_ratio", "noise_ratio", "compile_s", "baseline_compile_s", "compile_ratio",
          "grad_rel_err", "plain_grad_rel_err", "wall_s", "device", "torch", "codegen", "worker")
MEMCOMPILE_FIELDS = ("budget", "predicted", "predicted_step", "reserve", "fits", "over_predicted", "choices",
                     "solver_status", "plan_text", "allocator_rounding")


def _run(*args: str, timeout: int = 400) -> str:
    run = subprocess.run([sys.executable, str(BENCHMARKS / "gpu_check.py"), "--cpu-smoke", *args],
                         capture_output=True, text=True, timeout=timeout)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    return run.stdout


@pytest.fixture(scope="module")
def smoke(tmp_path_factory) -> tuple[Path, dict[str, dict], str]:
    out = tmp_path_factory.mktemp("gpu_check")
    log = _run("--out", str(out), "--time-budget-s", "300")
    return out, gpu_check.latest_rows(out / "rows.jsonl"), log


def test_smoke_rows_have_every_field(smoke) -> None:
    out, rows, log = smoke
    assert set(rows) == {r.id for r in SMOKE}, log
    for row in rows.values():
        assert row["status"] == "ok", row
        missing = [f for f in FIELDS if row.get(f) is None]
        assert not missing, (row["id"], missing)
        assert row["codegen"] == "aot_eager" and row["batch"] == row["main_batch"] == 2
        assert row["plain_grad_rel_err"] < 1e-5  # the FX interpreter is eager PyTorch's arithmetic
        assert row["grad_rel_err"] < 5e-2  # bf16 autocast, recomputations in another order
    assert rows["gpt2/bf16/inductor"]["compile_ratio"] == 1.0
    assert "setup_s" in rows["gpt2/bf16/inductor"]


def test_smoke_memcompile_rows_honour_budget_and_prediction(smoke) -> None:
    _out, rows, _log = smoke
    ours = [r for r in rows.values() if r["kind"] == "mc"]
    assert len(ours) == 2
    for row in ours:
        missing = [f for f in MEMCOMPILE_FIELDS if row.get(f) is None]
        assert not missing, (row["id"], missing)
        assert row["peak"] <= row["budget"] and row["fits"] is True, row["plan_summary"]
        assert row["predicted"] <= row["budget"]
        assert row["over_predicted"] == row["peak"] - row["predicted"] <= 0, row["plan_summary"]
        assert "exact=True" in row["allocator_rounding"]  # the CPU: no allocator blocks
    assert rows["gpt2/bf16/mc@inductor"]["budget"] == rows["gpt2/bf16/inductor"]["peak"]
    floor = rows["gpt2/bf16/mc@floor"]
    assert floor["budget"] == floor["floor"] < rows["gpt2/bf16/inductor"]["peak"]
    assert rows["gpt2/bf16/amb0.5"]["peak"] < rows["gpt2/bf16/inductor"]["peak"]  # the fraction took effect
    assert rows["gpt2/bf16/hf_ckpt"]["peak"] < rows["gpt2/bf16/inductor"]["peak"]  # so did checkpointing


def test_smoke_rerun_from_its_rows_runs_nothing_and_the_table_reads_them(smoke, tmp_path) -> None:
    out, rows, _log = smoke
    log = _run("--out", str(tmp_path), "--resume", str(out / "rows.jsonl"), timeout=120)
    assert "nothing to run" in log
    assert gpu_check.latest_rows(tmp_path / "rows.jsonl") == rows
    table = gpu_table.markdown(gpu_table.load([out / "rows.jsonl"]))
    assert "Budget honoured: 2 of 2 rows" in table and "Measured <= predicted: 2 of 2" in table
    assert table.count("| mc@") == 2 and "### gpt2/bf16" in table


def test_cuda_rows_need_only_earlier_rows() -> None:
    ids = [r.id for r in ROWS]
    assert len(ids) == len(set(ids))
    for position, row in enumerate(ROWS):
        assert row.kind in ("inductor", "inductor_b4", "amb", "hf_ckpt", "mc", "int8", "offload", "max_batch")
        for dep in row.deps:
            assert dep in ids[:position], (row.id, dep)
    assert set(QUICK) <= set(ids)
    assert [r.id for r in ROWS[:4]] == ["gpt2/bf16/inductor", "gpt2/bf16/amb0.8", "gpt2/bf16/amb0.5",
                                        "gpt2/bf16/mc@floor"]
    assert {r.model for r in ROWS} == {"gpt2", "llama"} and {r.dtype for r in ROWS} == {"bf16", "fp32"}


def test_first_cuda_call_starts_the_decisive_rows_by_the_estimates() -> None:
    timeline = simulate(ROWS, workers=4, budget_s=480, margin_s=20, smoke=False)
    ends = {row_id: end for _start, end, _worker, row_id in timeline}
    for name in ("inductor", "amb0.8", "amb0.5", "mc@floor", "mc@amb0.5", "mc@amb0.8", "amb0.2", "hf_ckpt"):
        assert ends[f"gpt2/bf16/{name}"] <= 460, name
    assert max(ends.values()) <= 460  # the time guard: nothing is started that would end later


def test_schedule_guards_time_and_dependencies(tmp_path) -> None:
    now = [0.0]
    rows = [Row("gpt2", "bf16", "amb0.5"), Row("gpt2", "bf16", "mc@amb0.5"), Row("gpt2", "bf16", "mc@floor")]
    schedule = Schedule(rows, {}, deadline=200.0, smoke=False, out=tmp_path, clock=lambda: now[0])
    first = schedule.next_for(None)
    assert first.id == "gpt2/bf16/amb0.5"  # 90 s setup + 75 s: fits; the floor (90 + 330 s) does not
    assert schedule.next_for(None) == "wait"  # mc@amb0.5 needs amb0.5, which runs
    schedule.finish(first.id, "error")
    assert schedule.next_for("gpt2/bf16") is None  # its source failed: skipped; the floor never fits
    (skipped,) = [json.loads(line) for line in (tmp_path / "rows.jsonl").read_text().splitlines()]
    assert skipped["id"] == "gpt2/bf16/mc@amb0.5" and skipped["status"] == "skipped"
    # done rows are not run again, and their measured time replaces the estimate
    done = {"gpt2/bf16/amb0.5": {"status": "ok", "model": "gpt2", "cost_kind": "amb", "wall_s": 20.0}}
    again = Schedule(rows[:2], done, deadline=400.0, smoke=False, out=tmp_path, clock=lambda: 0.0)
    assert [r.id for r in again.pending] == ["gpt2/bf16/mc@amb0.5"] and again.observed == {("gpt2", "amb"): 20.0}


def test_max_batch_estimate_and_probes() -> None:
    mib = 2**20
    # plain Inductor: 600 MiB at batch 4, 1000 at 8: 100 MiB a sample over 200 MiB; memcompile's
    # floor at batch 8 is 440 MiB: 30 MiB a sample, so 600 MiB holds batch 13
    estimate = estimate_batch(600 * mib, 4, 1000 * mib, 8, 440 * mib, 600 * mib)
    assert (estimate.static_bytes, estimate.per_sample_bytes, estimate.batch) == (200 * mib, 30 * mib, 13)
    per = estimate.per_sample_bytes
    # memcompile fits: its room under the budget says nothing (it plans up to it): stop
    assert next_batch(13, {"fits": True, "peak": 500 * mib}, 600 * mib, per, 13, reads_room=False) is None
    # PyTorch fits with 70 MiB to spare: two samples more
    assert next_batch(13, {"fits": True, "peak": 530 * mib}, 600 * mib, per, 13, reads_room=True) == 15
    # infeasible, smallest budget 661 MiB: 61 MiB over, three samples fewer
    assert next_batch(13, {"fits": False, "min_feasible": 661 * mib}, 600 * mib, per, None, reads_room=False) == 10
    # over, after a smaller batch fitted: stop
    assert next_batch(15, {"fits": False, "peak": 620 * mib}, 600 * mib, per, 13, reads_room=True) is None
    assert estimate_batch(600, 4, 1000, 8, 10**9, 600).batch == 1  # never below one
