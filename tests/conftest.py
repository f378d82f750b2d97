import os

import pytest
import torch

# keep the default suite deterministic and quick on 2 cores
torch.set_num_threads(min(2, os.cpu_count() or 1))


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield
