from __future__ import annotations

import pytest

from .harness import fault_stack


@pytest.fixture(scope="session")
def faults_stack():
    """One private PostgreSQL + Redis + processes for the fault suite; each
    test calls ``ensure_running()`` first, so what one test broke is back."""
    stack = fault_stack()
    yield stack
    stack.stop()


@pytest.fixture
def stack(faults_stack):
    faults_stack.ensure_running()
    return faults_stack
