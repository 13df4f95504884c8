"""Fixtures for every module in tests/parallel/ (tensor, pipeline, torchrun)."""

import pytest
import torch


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One torch thread here, one in the worker: the two ranks share 2 cores."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
