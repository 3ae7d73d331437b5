"""Shared test setup: one torch thread per test worker.

The suite runs two workers on two cores; with torch's default of one thread per core
each worker's kernels spin against the other's (tiny ops become ~1000x slower)."""
import pytest
import torch


@pytest.fixture(autouse=True)
def _one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
