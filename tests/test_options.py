import math

import pytest
from hypothesis import given, strategies as st

import memcompile
from memcompile.options import make_options, parse_bytes


@pytest.mark.parametrize("text, expected", [
    ("20GB", 20 * 10**9), ("20GiB", 20 * 2**30), ("512MB", 512 * 10**6), ("1.5 GiB", int(1.5 * 2**30)),
    (" 1.5gib ", int(1.5 * 2**30)), ("100", 100), ("64 kb", 64_000), ("3 MiB", 3 * 2**20), (12345, 12345),
])
def test_accepted_sizes(text, expected):
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("bad", [-1, 0, "abc", "20XB", float("nan"), "nan GB", "", "GB", "-5GB", True, None, [1]])
def test_rejected_sizes_say_what_is_accepted(bad):
    with pytest.raises(ValueError, match="expected"):
        parse_bytes(bad)


@given(st.text(max_size=12))
def test_parser_never_crashes_untyped(text):
    try:
        value = parse_bytes(text)
    except ValueError as e:
        assert "limit" in str(e)
    else:
        assert isinstance(value, int) and value > 0


@given(st.floats(min_value=0.001, max_value=1e6, allow_nan=False), st.sampled_from(["KB", "MiB", "gb", "GiB", "tb"]),
       st.sampled_from(["", " ", "  "]))
def test_parser_scales_units(number, unit, space):
    factor = {"kb": 1e3, "mib": 2**20, "gb": 1e9, "gib": 2**30, "tb": 1e12}[unit.lower()]
    text = f"{number!r}{space}{unit}"
    if int(number * factor) <= 0:
        with pytest.raises(ValueError):
            parse_bytes(text)
    else:
        assert parse_bytes(text) == int(float(repr(number)) * factor)


def test_budget_options_are_validated():
    with pytest.raises(TypeError, match="unknown option"):
        memcompile.budget("1GB", solver_time=3)
    with pytest.raises(ValueError, match="codegen"):
        memcompile.budget("1GB", codegen="tvm")
    with pytest.raises(ValueError, match="reserve"):
        memcompile.budget("1GB", reserve="2GB")
    with pytest.raises(ValueError, match="time_limit_s"):
        memcompile.budget("1GB", time_limit_s=-1)
    backend = memcompile.budget("1GB", reserve="100MB", time_limit_s=2)
    assert backend.options.step_budget_bytes == 10**9 - 10**8
    assert not math.isnan(backend.options.time_limit_s)


@pytest.mark.parametrize("given_value, device, offered", [
    ("default", "cuda", True), ("default", "cpu", False), ("auto", "xpu", True), (None, "cpu", False),
    (False, "cuda", False), (True, "cpu", True), (True, "cuda", True),
])
def test_offload_is_offered_where_the_device_has_its_own_memory_unless_told(given_value, device, offered):
    from memcompile.options import make_options
    from memcompile.planner import _store_options

    options = make_options(10**9) if given_value == "default" else make_options(10**9, offload=given_value)
    assert _store_options(options, device).offload is offered


@pytest.mark.parametrize("bad", ["yes", 1.0, "host", 0.5])
def test_offload_rejects_other_values_naming_the_option(bad):
    with pytest.raises(ValueError, match="offload="):
        memcompile.budget("1GB", offload=bad)


def test_experiments_are_read_from_the_environment_once_where_the_options_are_made(monkeypatch):
    from memcompile.options import Experiments

    monkeypatch.setenv("MEMCOMPILE_FUSION_CHECK", "0")
    monkeypatch.setenv("MEMCOMPILE_TIME_OPS", "1")
    options = make_options("1GB")
    assert options.experiments == Experiments(fusion_check=False)
    monkeypatch.setenv("MEMCOMPILE_STOCK_CANDIDATES", "0")  # after: these options do not change
    assert options.experiments.stock_candidates
    assert "fusion_check=False" in options.describe()  # so in every key made from the options
    given = Experiments(adjacent_reuse=False)
    assert make_options("1GB", experiments=given).experiments is given  # the environment is not read then
    with pytest.raises(ValueError, match="experiments="):
        make_options("1GB", experiments={"fusion_check": False})
