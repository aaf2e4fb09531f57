"""Private torch APIs live in memcompile/_torch_private.py alone."""

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]
PRIVATE = re.compile(r"\btorch\._[a-z]")


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
