"""Private torch APIs live in the package memcompile/_torch_private/ alone."""

import pathlib
import re

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
