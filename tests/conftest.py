import pytest
import torch

torch.set_num_threads(2)


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    """Each test compiles from scratch: no Dynamo cache entries leak between tests."""
    import torch._dynamo  # noqa: F401  (tests may use private torch APIs; the package may not)

    torch._dynamo.reset()
    yield
    torch._dynamo.reset()
