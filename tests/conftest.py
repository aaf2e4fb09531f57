import os

import pytest
import torch

# Tests plan afresh: a plan stored by an earlier test (or run) would answer for a graph that a
# test has patched the planner's inputs of. Tests of the store pass plan_store= explicitly.
os.environ["MEMCOMPILE_PLAN_STORE"] = "0"
# Tests run the product's models and rules: experiments a developer's shell turned off
# (MEMCOMPILE_FUSION_CHECK=0...) are on again; a test turns one off through the options.
for _variable in ("MEMCOMPILE_FUSION_CHECK", "MEMCOMPILE_RECOMPUTE_FUSION", "MEMCOMPILE_STOCK_CANDIDATES",
                  "MEMCOMPILE_TIME_OPS", "MEMCOMPILE_LIFETIME_FUSION", "MEMCOMPILE_ADJACENT_REUSE",
                  "MEMCOMPILE_REPEATED_BLOCKS"):
    os.environ.pop(_variable, None)

torch.set_num_threads(2)


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    """Each test compiles from scratch: no Dynamo cache entries leak between tests."""
    import torch._dynamo  # noqa: F401  (tests may use private torch APIs; the package may not)

    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.fixture(autouse=True)
def _gcc_only_where_marked(request, monkeypatch):
    """`make test-fast` (-m "not inductor") runs no gcc: a test that builds Inductor's C++ without
    the `inductor` mark fails, saying so, instead of slowing the fast run down unnoticed."""
    if request.node.get_closest_marker("inductor") is not None:
        return
    from torch._inductor import cpp_builder

    def build(self) -> None:
        pytest.fail("this test compiles C++ with Inductor: mark it @pytest.mark.inductor (or use codegen='aot_eager')",
                    pytrace=False)

    monkeypatch.setattr(cpp_builder.CppBuilder, "build", build)
