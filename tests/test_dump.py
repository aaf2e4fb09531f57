"""Plan views: text, JSON round trip, the HTML picture, the CLI and MEMCOMPILE_DUMP_DIR."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
import xml.etree.ElementTree as ET
from html.parser import HTMLParser
from pathlib import Path

import pytest
import torch
import torch._dynamo

import memcompile
from memcompile.plan_dump import (find_backend, load_plans, plan_from_json, plan_to_dict, plans_from_json,
                             to_html, to_json, to_text, write_dump_dir)
from memcompile.plan import Decision, Plan

from models import MLP

SVG = "{http://www.w3.org/2000/svg}"
REPO = Path(__file__).resolve().parents[1]


def hand_plan(graph_id: str = "graph_0", **changes) -> Plan:
    """Every choice, a reason, a source line with markup characters, a reserve."""
    decisions = (
        Decision("mm", "mm.default", (64, 128), "float32", 32768, "recompute", 2.5e-5, "",
                 'y = a @ b  # <"matmul"> & co'),
        Decision("relu", "relu.default", (64, 128), "float16", 16384, "keep", 0.0,
                 "random op: recomputing would draw new numbers", "x = F.dropout(F.relu(y))"),
        Decision("view", "view.default", (8192,), "float32", 4096, "recompute", 1e-7,
                 "view of an activation: keeping it would pin its base", ""),
        Decision("scalar", "sum.default", (), "float32", 4, "keep", 0.0, "", ""),
    )
    before = (1000, 50_000, 90_000, 120_000, 80_000, 30_000, 5_000)
    after = (1000, 30_000, 50_000, 60_000, 70_000, 95_000, 40_000, 5_000)
    fields = dict(
        graph_id=graph_id, budget_bytes=110_000, reserve_bytes=10_000,
        predicted_peak_before_bytes=max(before), predicted_peak_bytes=max(after),
        peak_phase="backward", peak_node="mm_recomputed",
        peak_breakdown=(("saved_activations", 52_000), ("temporaries", 33_000), ("gradients", 10_000)),
        decisions=decisions, added_time_s=2.51e-5, solver_status="feasible", solve_s=0.25, gap=0.125,
        live_bytes_before=before, live_bytes_after=after,
    )
    fields.update(changes)
    return Plan(**fields)


@pytest.fixture(scope="module")
def real_backend():
    """One real plan from a tiny MLP, compiled under ~0.9 of its stock peak so it recomputes."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model, x = MLP(32, 6), torch.randn(1024, 32)

    def compile_and_step(limit: int) -> memcompile.Backend:
        backend = memcompile.budget(limit, codegen="aot_eager")
        torch.compile(model, backend=backend)(x).sum().backward()
        return backend

    stock = compile_and_step(10**12).plans[0].predicted_peak_before_bytes
    torch._dynamo.reset()
    try:
        backend = compile_and_step(int(0.9 * stock))
    except memcompile.InfeasibleBudgetError as error:
        torch._dynamo.reset()
        backend = compile_and_step(error.min_feasible_bytes)
    torch._dynamo.reset()
    plan = backend.plans[0]
    assert any(d.choice == "recompute" for d in plan.decisions), plan.summary()
    return backend


def all_plans(real_backend) -> list[Plan]:
    return [hand_plan(), real_backend.plans[0]]


def svg_roots(html: str) -> list[ET.Element]:
    return [ET.fromstring(m) for m in re.findall(r"<svg\b.*?</svg>", html, flags=re.S)]


def test_json_round_trip(real_backend, tmp_path):
    plans = all_plans(real_backend)
    text = to_json(plans)
    assert json.loads(text)["schema_version"] == 3
    assert plans_from_json(text) == plans
    assert to_json(plans_from_json(text)) == text  # stable output
    path = tmp_path / "plans.json"
    assert memcompile.dump(plans, format="json", path=path) == text
    assert load_plans(path) == plans
    assert plan_from_json(json.dumps(plan_to_dict(plans[0]))) == plans[0]


def test_json_spells_non_finite_floats_and_rejects_other_versions():
    plan = hand_plan(gap=math.inf)
    text = to_json([plan])
    assert "Infinity" not in text and plans_from_json(text) == [plan]
    with pytest.raises(ValueError, match="schema_version"):
        plans_from_json(json.dumps({"schema_version": 4, "plans": []}))
    broken = json.loads(text)
    del broken["plans"][0]["gap"]
    with pytest.raises(ValueError, match="gap"):
        plans_from_json(json.dumps(broken))


def test_text_has_header_breakdown_and_table_largest_first(real_backend):
    plan = hand_plan()
    text = memcompile.dump(plan)
    for expected in ("graph_0", "107.42 KiB", "reserve 9.77 KiB", "predicted peak", "117.19 KiB -> 92.77 KiB",
                     "feasible in 0.25 s, gap 12.5%", "25.10 us", "saved_activations", "recompute 2 =",
                     "random op: recomputing", '<"matmul"> & co', "[64, 128]", "float16"):
        assert expected in text, expected
    table = text[text.index("largest first"):].splitlines()[2:]
    assert [row.split()[0] for row in table] == ["mm", "relu", "view", "scalar"]
    assert memcompile.dump(real_backend).startswith("memcompile plan graph_0")
    assert "no plans" in to_text([])


def test_dump_accepts_backend_compiled_model_plan_and_list(real_backend):
    plans = real_backend.plans
    assert memcompile.dump(plans[0]) == memcompile.dump(real_backend) == memcompile.dump(list(plans))
    compiled = torch.compile(MLP(8, 1), backend=real_backend)
    assert find_backend(compiled) is real_backend
    assert memcompile.dump(compiled) == memcompile.dump(real_backend)
    with pytest.raises(TypeError):
        memcompile.dump(torch.compile(MLP(8, 1), backend="eager"))
    with pytest.raises(ValueError):
        memcompile.dump(plans[0], format="pdf")


def test_html_is_well_formed_and_marks_the_peak(real_backend):
    plans = all_plans(real_backend)
    html = memcompile.dump(plans, format="html")
    ET.fromstring(html)  # the whole page is well-formed XML, doctype aside
    HTMLParser().feed(html)
    assert "<script" not in html and "http://" not in html.replace('xmlns="http://www.w3.org/', "")
    roots = svg_roots(html)
    assert len(roots) == len(plans)
    for plan, svg in zip(plans, roots):
        peak = svg.find(f".//{SVG}circle[@class='peak']")
        assert int(peak.get("data-peak-bytes")) == plan.predicted_peak_bytes
        assert plan.live_bytes_after[int(peak.get("data-step"))] == plan.predicted_peak_bytes
        budget = svg.find(f".//{SVG}line[@class='budget']")
        assert int(budget.get("data-bytes")) == plan.budget_bytes - plan.reserve_bytes
        assert svg.find(f".//{SVG}polyline[@class='before']") is not None
        after = svg.find(f".//{SVG}polyline[@class='after']")
        assert len(after.get("points").split()) == len(plan.live_bytes_after)
        # the marker sits on the peak of the drawn curve
        ys = [float(p.split(",")[1]) for p in after.get("points").split()]
        assert float(peak.get("cy")) == pytest.approx(min(ys), abs=0.11)
        assert "MiB" in "".join(svg.itertext())


def test_html_without_timeline_or_plans():
    svg = svg_roots(to_html([hand_plan(live_bytes_before=(), live_bytes_after=())]))[0]
    assert svg.find(f".//{SVG}circle[@class='peak']") is None
    ET.fromstring(to_html([]))


def test_cli_prints_text_and_writes_html(tmp_path):
    plan_file = tmp_path / "graph_0.json"
    plan_file.write_text(to_json([hand_plan()]))
    out = tmp_path / "graph_0.html"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    run = subprocess.run([sys.executable, "-m", "memcompile", "dump", str(plan_file), "--html", str(out)],
                         capture_output=True, text=True, env=env, timeout=120)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == to_text([hand_plan()])
    assert out.read_text() == to_html([hand_plan()])


def test_cli_reports_a_bad_file_without_traceback(tmp_path, capsys):
    from memcompile.__main__ import main  # in-process: one subprocess (importing torch) is enough

    assert main(["dump", str(tmp_path / "missing.json")]) == 2
    assert "missing.json" in capsys.readouterr().err
    (tmp_path / "other.json").write_text('{"rows": []}')
    assert main(["dump", str(tmp_path / "other.json")]) == 2
    assert "not a memcompile plan file" in capsys.readouterr().err


def test_dump_dir_env_writes_json_and_html_per_graph(tmp_path, monkeypatch):
    monkeypatch.setenv("MEMCOMPILE_DUMP_DIR", str(tmp_path / "plans"))
    backend = memcompile.budget(10**12, codegen="aot_eager")
    torch.compile(MLP(16, 2), backend=backend)(torch.randn(8, 16)).sum().backward()
    plan = backend.plans[0]
    assert load_plans(tmp_path / "plans" / f"{plan.graph_id}.json") == [plan]
    svg_roots((tmp_path / "plans" / f"{plan.graph_id}.html").read_text())


def test_dump_dir_failure_is_logged_not_raised(tmp_path, caplog):
    blocker = tmp_path / "file"
    blocker.write_text("")
    with caplog.at_level("WARNING", logger="memcompile"):
        assert write_dump_dir(hand_plan(), str(blocker / "sub")) == ()
    assert "could not write" in caplog.text
    assert write_dump_dir(hand_plan(), None) == ()
