import os

import pytest
import torch

# keep the default suite deterministic and quick on 2 cores
torch.set_num_threads(min(2, os.cpu_count() or 1))

# without a GPU the Triton kernels (lambdanet.kernels) run on CPU tensors in Triton's interpreter; the variable
# must be set before the kernels are first imported (triton.jit reads it when it decorates them)
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield
