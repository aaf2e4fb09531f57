"""The plan store: a later launch reads the outcome an earlier one planned, and only for the same
graph, options and machine (memcompile/plan_store.py)."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import textwrap

import pytest
import torch

import memcompile
from memcompile import plan_cache, planner
from models import WithLoss, build

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def _step(model, x, budget, store, codegen="aot_eager", **options):
    """One compiled step from a fresh start (no Dynamo or in-process solver cache): (plan, grads, peak)."""
    torch.compiler.reset()
    plan_cache.clear()
    model.zero_grad(set_to_none=True)
    x.grad = None
    backend = memcompile.budget(budget, codegen=codegen, time_limit_s=2, plan_store=store, **options)
    compiled = torch.compile(WithLoss(model), backend=backend)
    compiled(x).backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    x.grad = None  # a gradient held at the step's start would count (accumulation)
    peak = memcompile.measure_peak(lambda: compiled(x).backward(), live_at_start=[model, x]).peak_bytes
    model.zero_grad(set_to_none=True)
    x.grad = None
    torch.compiler.reset()
    return backend.plans[0], grads, peak


def _floor(model, x, store) -> int:
    torch.compiler.reset()
    with pytest.raises(memcompile.InfeasibleBudgetError) as error:
        torch.compile(WithLoss(model), backend=memcompile.budget(1, codegen="aot_eager", time_limit_s=2,
                                                                  plan_store=store))(x)
    torch.compiler.reset()
    return error.value.min_feasible_bytes


def _fitting_budget(model, x, margin: float = 1.15) -> int:
    """A budget above the floor that a run meets (a first step of several regions may name the
    floor of the regions seen so far: raised until one runs)."""
    budget = int(_floor(model, x, False) * margin)
    for _ in range(4):
        try:
            _step(model, x, budget, False)
            return budget
        except memcompile.InfeasibleBudgetError as error:
            budget = int(error.min_feasible_bytes * margin)
    raise AssertionError("no budget ran")


def _no_search(monkeypatch) -> None:
    def searched(*args, **kwargs):
        raise AssertionError("planned again although the store holds this graph's outcome")
    monkeypatch.setattr(planner, "_search", searched)


@pytest.mark.parametrize("arch", ["mlp", "convbn"])
def test_a_second_launch_reads_the_plan_and_runs_it_within_the_budget(tmp_path, monkeypatch, arch):
    model, x = build(arch, 64 if arch == "mlp" else 8, 3, 32 if arch == "mlp" else 4, seed=1)
    budget = _fitting_budget(model, x)
    first, grads, peak = _step(model, x, budget, str(tmp_path))
    assert not first.from_plan_store and peak <= budget
    assert list(tmp_path.rglob("*.pkl")), "nothing was stored"
    _no_search(monkeypatch)
    again, grads_again, peak_again = _step(model, x, budget, str(tmp_path))
    assert again.from_plan_store
    assert again.decisions == first.decisions
    assert again.predicted_peak_bytes == first.predicted_peak_bytes
    assert peak_again == peak <= budget
    for a, b in zip(grads, grads_again):
        assert torch.equal(a, b)
    assert "read from the plan store" in memcompile.dump(again)


def test_an_infeasible_budget_is_answered_from_the_store(tmp_path, monkeypatch):
    model, x = build("mlp", 64, 3, 32, seed=2)
    floor = _floor(model, x, str(tmp_path))
    _no_search(monkeypatch)
    assert _floor(model, x, str(tmp_path)) == floor


def test_another_budget_shape_or_switch_is_planned_afresh(tmp_path):
    model, x = build("mlp", 64, 3, 32, seed=3)
    budget = _fitting_budget(model, x, 1.2)
    _step(model, x, budget, str(tmp_path))
    stored = set(tmp_path.rglob("*.pkl"))
    for change in ("budget", "shape", "switch"):
        b, inputs = (budget + 4096, x) if change == "budget" else (budget, x)
        if change == "shape":
            inputs = torch.randn(x.shape[0] + 8, x.shape[1], requires_grad=True)
            b = _fitting_budget(model, inputs, 1.2)
        with pytest.MonkeyPatch.context() as patch:
            if change == "switch":  # an experiment: part of the options, so of the key
                patch.setenv("MEMCOMPILE_RECOMPUTE_FUSION", "0")
            plan, _, _ = _step(model, inputs, b, str(tmp_path))
        assert not plan.from_plan_store, change
        now = set(tmp_path.rglob("*.pkl"))
        assert now > stored, f"{change}: no new entry"
        stored = now


def test_a_damaged_entry_is_a_miss_and_is_replaced(tmp_path):
    model, x = build("mlp", 64, 2, 32, seed=4)
    budget = _fitting_budget(model, x, 1.2)
    first, _, _ = _step(model, x, budget, str(tmp_path))
    (entry,) = [p for p in tmp_path.rglob("*.pkl") if p.stat().st_size > 0][-1:]
    entry.write_bytes(b"not a pickle")
    plan, _, peak = _step(model, x, budget, str(tmp_path))
    assert not plan.from_plan_store and plan.decisions == first.decisions and peak <= budget
    plan, _, _ = _step(model, x, budget, str(tmp_path))
    assert plan.from_plan_store


def test_symbolic_sizes_are_not_stored(tmp_path):
    model, x = build("mlp", 32, 2, 16, seed=5)
    torch.compiler.reset()
    backend = memcompile.budget(10**9, codegen="aot_eager", plan_store=str(tmp_path))
    compiled = torch.compile(WithLoss(model), backend=backend, dynamic=True)
    compiled(x).backward()
    torch.compiler.reset()
    assert backend.plans and not list(tmp_path.rglob("*.pkl"))


def test_the_option_is_validated_and_off_writes_nothing(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match="plan_store"):
        memcompile.budget("1GB", plan_store=3)
    assert memcompile.budget("1GB", plan_store=False).options.plan_store_dir == ""
    assert memcompile.budget("1GB", plan_store=str(tmp_path)).options.plan_store_dir == str(tmp_path)
    monkeypatch.setenv("MEMCOMPILE_PLAN_STORE", str(tmp_path / "env"))
    assert memcompile.budget("1GB").options.plan_store_dir == str(tmp_path / "env")
    monkeypatch.setenv("MEMCOMPILE_PLAN_STORE", "0")
    assert memcompile.budget("1GB").options.plan_store_dir == ""
    model, x = build("mlp", 32, 2, 16, seed=6)
    _step(model, x, 10**9, False)
    assert not list(tmp_path.rglob("*.pkl"))


_LAUNCH = textwrap.dedent("""
    import sys, torch, memcompile
    sys.path.insert(0, sys.argv[3])
    from models import WithLoss, build
    model, x = build("mlp", 64, 3, 32, seed=7)
    backend = memcompile.budget(int(sys.argv[1]), time_limit_s=2, plan_store=sys.argv[2])
    torch.compile(WithLoss(model), backend=backend)(x).backward()
    plan = backend.plans[0]
    print("RESULT", plan.from_plan_store, plan.predicted_peak_bytes, plan.solver_status)
""")


@pytest.mark.inductor
def test_two_launches_of_one_script_under_inductor(tmp_path):
    """The key is stable across processes (no addresses, ids or timings in it)."""
    model, x = build("mlp", 64, 3, 32, seed=7)
    budget = _fitting_budget(model, x, 1.1)
    script = tmp_path / "launch.py"
    script.write_text(_LAUNCH)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("MEMCOMPILE_PLAN_STORE", None)
    tests = str(pathlib.Path(__file__).parent)
    results = []
    for _ in range(2):
        out = subprocess.run([sys.executable, str(script), str(budget), str(tmp_path / "store"), tests],
                             capture_output=True, text=True, env=env, timeout=600)
        line = [r for r in out.stdout.splitlines() if r.startswith("RESULT")]
        assert line, out.stderr[-3000:]
        results.append(line[0].split(maxsplit=3))
    assert results[0][1] == "False" and results[1][1] == "True"
    assert results[0][2:] == results[1][2:]


_CACHED_LAUNCH = textwrap.dedent("""
    import sys, torch, memcompile
    from torch._dynamo.utils import counters
    sys.path.insert(0, sys.argv[3])
    from models import WithLoss, build
    model, x = build("attention", 16, 2, 8, seed=3)
    b = memcompile.budget(int(sys.argv[1]), time_limit_s=2, plan_store=sys.argv[2])
    step = torch.compile(WithLoss(model), backend=b)
    step(x).backward()
    grads = torch.cat([p.grad.flatten() for p in model.parameters()]).double().sum().item()
    model.zero_grad(set_to_none=True)
    x.grad = None
    peak = memcompile.measure_peak(lambda: step(x).backward(), live_at_start=[model, x]).peak_bytes
    plan = b.plans[0]
    print("RESULT", counters["aot_autograd"]["autograd_cache_hit"], plan.from_plan_store,
          plan.predicted_peak_bytes, peak, repr(grads), plan.solver_status)
""")


@pytest.mark.inductor
def test_a_later_launch_takes_the_compiled_graphs_and_their_plan_from_the_caches(tmp_path):
    """AOTAutograd's cache serves a later launch's graphs (no trace, no partition), keyed by the
    partitioner's uuid, which holds everything the plan depends on; the plan comes from the plan
    store under the same key: the same plan, peak and gradients. Where the plan store lost it,
    the graph is compiled again, within the budget, with the same gradients."""
    model, x = build("attention", 16, 2, 8, seed=3)
    budget = _fitting_budget(model, x, 1.1)
    script = tmp_path / "launch.py"
    script.write_text(_CACHED_LAUNCH)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")}
    env.pop("MEMCOMPILE_PLAN_STORE", None)
    tests = str(pathlib.Path(__file__).parent)
    store = tmp_path / "store"
    results = []
    for launch in range(3):
        if launch == 2:  # the plan store emptied, AOTAutograd's cache kept
            for record in store.rglob("*.pkl"):
                record.unlink()
        out = subprocess.run([sys.executable, str(script), str(budget), str(store), tests],
                             capture_output=True, text=True, env=env, timeout=600)
        line = [r for r in out.stdout.splitlines() if r.startswith("RESULT")]
        assert line, out.stderr[-3000:]
        results.append(line[0].split(maxsplit=6)[1:])
    first, cached, recompiled = results
    assert first[:2] == ["0", "False"] and cached[:2] == ["1", "True"] and recompiled[1] == "False"
    assert first[2:] == cached[2:]  # predicted and measured peak, gradients, status
    # planned again (op timings measured again may choose another plan): the same gradients
    assert recompiled[4] == first[4] and int(first[3]) <= budget and int(recompiled[3]) <= budget


# ---- whose folders are trusted --------------------------------------------------------------

def _record(directory, key="ab" + "0" * 62):
    from memcompile import plan_store

    plan_store.save(str(directory), key, plan_store.StoredLadder((("chunk_loss", 4, "test"),), True))
    return key


@pytest.mark.skipif(not hasattr(os, "getuid"), reason="POSIX owners and modes")
def test_the_store_creates_its_folders_for_this_user_alone(tmp_path):
    from memcompile import plan_store

    store = tmp_path / "new" / "plans"
    key = _record(store)
    for folder in (tmp_path / "new", store, store / key[:2]):
        assert folder.stat().st_mode & 0o777 == 0o700, (folder, oct(folder.stat().st_mode))
    assert plan_store.load_ladder(str(store), key) == ((("chunk_loss", 4, "test"),), True)


@pytest.mark.skipif(not hasattr(os, "getuid"), reason="POSIX owners and modes")
def test_a_folder_others_can_write_is_neither_read_nor_written(tmp_path, caplog):
    from memcompile import plan_store

    store = tmp_path / "plans"
    key = _record(store)
    store.chmod(0o777)  # another local user could plant a pickle here
    with caplog.at_level("WARNING", logger="memcompile"):
        assert plan_store.load_ladder(str(store), key) is None
    assert "not this user's alone" in caplog.text
    other = "cd" + "0" * 62
    _record(store, other)
    assert not (store / other[:2]).exists()


@pytest.mark.skipif(not hasattr(os, "getuid") or os.getuid() != 0, reason="changing a file's owner needs root")
def test_a_record_another_user_owns_is_not_read(tmp_path):
    from memcompile import plan_store

    store = tmp_path / "plans"
    key = _record(store)
    os.chown(store / key[:2] / f"{key}.pkl", 4242, -1)
    assert plan_store.load_ladder(str(store), key) is None
    os.chown(store / key[:2] / f"{key}.pkl", 0, -1)
    assert plan_store.load_ladder(str(store), key) is not None


def test_a_damaged_record_is_a_miss(tmp_path):
    from memcompile import plan_store

    store = tmp_path / "plans"
    key = _record(store)
    path = store / key[:2] / f"{key}.pkl"
    path.write_bytes(path.read_bytes()[:10])  # truncated
    assert plan_store.load_ladder(str(store), key) is None
    path.write_bytes(b"not a pickle at all")
    assert plan_store.load_ladder(str(store), key) is None


_HEAD_LAUNCH = textwrap.dedent("""
    import sys, torch, memcompile
    from torch._dynamo.utils import counters
    sys.path.insert(0, sys.argv[2])
    from test_loss_head import TinyLM
    torch.manual_seed(0)
    model = TinyLM(vocab=1024, hidden=32, depth=2, bias=True, upcast=False, reduction="mean", ignore_index=-100)
    ids = torch.randint(0, 1024, (4, 128))
    b = memcompile.budget(10**10, time_limit_s=2, plan_store=sys.argv[1])
    torch.compile(model, backend=b)(ids).backward()
    print("RESULT", counters["aot_autograd"]["autograd_cache_hit"], b.plans[0].solver_status)
""")


@pytest.mark.inductor
def test_a_later_launch_of_a_graph_with_a_loss_head_is_served_by_the_caches(tmp_path):
    """A region with a loss head the ladder may chunk first carries that ask into its keys, not
    the rewrite's estimated cost: the device profile is measured in each process, and a key with
    the estimate in it missed every later launch (GPT style, 24 layers: 39.9 s where plain
    Inductor's later launch took 7.4)."""
    script = tmp_path / "launch.py"
    script.write_text(_HEAD_LAUNCH)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")}
    env.pop("MEMCOMPILE_PLAN_STORE", None)
    tests, store = str(pathlib.Path(__file__).parent), str(tmp_path / "store")
    hits = []
    for _ in range(2):
        out = subprocess.run([sys.executable, str(script), store, tests], capture_output=True, text=True, env=env,
                             timeout=600)
        line = [r for r in out.stdout.splitlines() if r.startswith("RESULT")]
        assert line, out.stderr[-3000:]
        hits.append(int(line[0].split()[1]))
    assert hits == [0, 1]
