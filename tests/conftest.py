import os

import pytest
import torch

# Tests plan afresh: a plan stored by an earlier test (or run) would answer for a graph that a
# test has patched the planner's inputs of. Tests of the store pass plan_store= explicitly.
os.environ["MEMCOMPILE_PLAN_STORE"] = "0"

torch.set_num_threads(2)


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    """Each test compiles from scratch: no Dynamo cache entries leak between tests."""
    import torch._dynamo  # noqa: F401  (tests may use private torch APIs; the package may not)

    torch._dynamo.reset()
    yield
    torch._dynamo.reset()
