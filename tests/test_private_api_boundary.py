"""Private torch APIs live in memcompile/_torch_private.py alone."""

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]
PRIVATE = re.compile(r"\btorch\._(?:[a-z]|C\b)")


def test_no_private_torch_api_outside_the_wrapper():
    offenders = []
    for folder in ("memcompile", "passes", "cost_models"):
        for path in (ROOT / folder).rglob("*.py"):
            if path.name == "_torch_private.py":
                continue
            for number, line in enumerate(path.read_text().splitlines(), 1):
                if PRIVATE.search(line.split("#")[0]):
                    offenders.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    assert not offenders, "private torch APIs outside memcompile/_torch_private.py:\n" + "\n".join(offenders)


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
    top_level = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert top_level == {"memcompile"}
