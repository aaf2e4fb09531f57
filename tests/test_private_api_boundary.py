"""Private torch APIs live in the package memcompile/_torch_private/ alone."""

import os
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PRIVATE = re.compile(r"\btorch\._(?:[a-z]|C\b)")
SEAM = ROOT / "memcompile" / "_torch_private"


def test_no_private_torch_api_outside_the_wrapper():
    offenders = []
    for folder in ("memcompile", "passes", "cost_models"):
        for path in (ROOT / folder).rglob("*.py"):
            if path.is_relative_to(SEAM):
                continue
            for number, line in enumerate(path.read_text().splitlines(), 1):
                if PRIVATE.search(line.split("#")[0]):
                    offenders.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    assert not offenders, "private torch APIs outside memcompile/_torch_private/:\n" + "\n".join(offenders)


def test_the_boundary_is_the_seam_package():
    """The folder the test above skips is the seam, where the private APIs are (not a path that no
    longer exists), and no module of the old name is left beside it."""
    assert not (ROOT / "memcompile" / "_torch_private.py").exists()
    assert any(PRIVATE.search(path.read_text()) for path in SEAM.glob("*.py"))


def test_passes_and_cost_models_install_inside_the_package():
    import memcompile.cost_models.device
    import memcompile.passes.liveness

    assert memcompile.passes.liveness.__name__ == "memcompile.passes.liveness"
    assert memcompile.cost_models.device.profile_for("h100").name == "h100"


def test_wheel_installs_everything_under_one_import_name(tmp_path):
    """The wheel holds memcompile/passes and memcompile/cost_models, and nothing top-level else."""
    import subprocess
    import sys
    import zipfile

    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(tmp_path), str(ROOT)],
        check=True, capture_output=True,
    )
    (wheel,) = tmp_path.glob("memcompile-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "memcompile/passes/liveness.py" in names
    assert "memcompile/cost_models/device.py" in names
    assert "memcompile/solver/activations.py" in names
    assert "memcompile/_torch_private/lowering.py" in names
    top_level = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert top_level == {"memcompile"}


_WATCH_PROBE = """
import torch
from torch._dynamo import convert_frame
from torch._inductor.choices import InductorChoices
from torch._inductor.codegen.wrapper import AllocateLine

def state():
    return (getattr(convert_frame.ConvertFrameAssert.__call__, "_memcompile_watched", False),
            InductorChoices.__dict__["can_fuse_horizontal"], AllocateLine.__dict__["should_reuse_buffer"])

stock = state()
import memcompile
assert state() == stock, "importing memcompile changed Dynamo or Inductor"
memcompile.named_backend  # the by-name API, imported on first use
assert state()[0], "a backend must watch skipped frames"
print("ok")
"""


def test_importing_memcompile_leaves_dynamo_and_inductor_as_they_are():
    """Only a backend (memcompile.budget, or the one looked up by name) watches Dynamo's frame
    conversions; Inductor's classes change only inside memcompile's own compiles (inductor_rules)."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", _WATCH_PROBE], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]
    budget_probe = _WATCH_PROBE.replace("memcompile.named_backend  # the by-name API, imported on first use",
                                        "memcompile.budget(10**9)")
    done = subprocess.run([sys.executable, "-c", budget_probe], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]


_PLAIN_COMPILE_PROBE = """
import json, re, sys
import torch
import torch.nn as nn
import torch._inductor.config as inductor_config
from torch._inductor.utils import run_and_get_code

def fused(s, u, dh, dout, x):  # a horizontal fusion memcompile's lifetime rule refuses in its graphs
    h = s * u
    return (dout.permute(1, 0) @ h, (dh * s).permute(1, 0) @ x)

def reused(x, w_big, w_wide, w_row):  # a dead buffer Inductor holds for a later allocation, memcompile frees
    c = (x @ w_big).sum(1, keepdim=True)
    p = (x + c).sin() @ w_wide
    return p.sum(1, keepdim=True) @ w_row

torch.manual_seed(0)
cases = ((fused, (torch.randn(256, 128), torch.randn(256, 128), torch.randn(256, 128), torch.randn(256, 64),
                  torch.randn(256, 64))),
         (reused, (torch.randn(128, 128), torch.randn(128, 1024), torch.randn(128, 512), torch.randn(1, 128))))
if sys.argv[1] == "after_memcompile":
    import memcompile
    model = nn.Sequential(nn.Linear(128, 512), nn.GELU(), nn.Linear(512, 128))
    x = torch.randn(64, 128, requires_grad=True)
    torch.compile(model, backend=memcompile.budget(10**9, plan_store=False))(x).sum().backward()
    torch.compiler.reset()
import memcompile
code, peaks = [], []
with inductor_config.patch(fx_graph_cache=False):
    for fn, args in cases:
        compiled = torch.compile(fn, fullgraph=True)
        code += run_and_get_code(compiled, *args)[1]
        peaks.append(memcompile.measure_peak(lambda: compiled(*args), live_at_start=list(args)).peak_bytes)
code = [re.sub(r"# AOT ID: .*", "", c) for c in code]  # a counter of the process's compiles
print(json.dumps({"code": code, "peaks": peaks}))
"""


@pytest.mark.inductor
def test_a_plain_compile_after_memcompiles_is_as_in_a_fresh_process():
    """memcompile's Inductor rules end with its compile: a user's plain torch.compile later in the
    same process generates the same code, and peaks the same, as in a process memcompile never ran in."""
    import json
    import subprocess
    import sys

    runs = {}
    for mode in ("fresh", "after_memcompile"):
        done = subprocess.run([sys.executable, "-c", _PLAIN_COMPILE_PROBE, mode], capture_output=True, text=True,
                              timeout=600, env={**os.environ, "MEMCOMPILE_PLAN_STORE": "0"})
        assert done.returncode == 0, done.stderr[-2000:]
        runs[mode] = json.loads(done.stdout.strip().splitlines()[-1])
    assert runs["fresh"]["code"] and runs["after_memcompile"]["code"] == runs["fresh"]["code"]
    assert runs["after_memcompile"]["peaks"] == runs["fresh"]["peaks"] and min(runs["fresh"]["peaks"]) > 0
