"""Fixtures of the governance tests."""

from __future__ import annotations

import json
import threading
import time

import pytest

from audit.replay.scenarios import load_scenarios
from audit.replay.server import make_server
from core.config import get_config
from tests.waiting import WAIT_SECONDS

from .helpers import MARKER


@pytest.fixture
def marker_model(tmp_path, monkeypatch):
    """A replay model that echoes the marker: in its first answer, in the
    arguments of a large lookup (whose result quotes them), and in its final
    answer."""
    scenarios = tmp_path / "scenarios"
    scenarios.mkdir()
    (scenarios / "gov_marker.json").write_text(
        json.dumps(
            {
                "description": "echoes the erasure marker everywhere",
                "turns": [
                    {
                        "text": f"Looking up {MARKER}.",
                        "tool_calls": [
                            {
                                "id": "call_marker",
                                "name": "lookup_docs",
                                "arguments": {"query": MARKER, "size": 6000},
                            }
                        ],
                        "usage": {"prompt_tokens": 40, "completion_tokens": 12},
                    },
                    {"text": f"The answer about {MARKER}.", "usage": {"prompt_tokens": 90, "completion_tokens": 8}},
                ],
            }
        )
    )
    server = make_server(load_scenarios(scenarios), "127.0.0.1", 0)
    thread = threading.Thread(target=server.run, name="replay-marker", daemon=True)
    thread.start()
    deadline = time.monotonic() + WAIT_SECONDS
    while server.base_url is None:
        assert thread.is_alive() and time.monotonic() < deadline
        time.sleep(0.01)
    monkeypatch.setattr(get_config(), "REPLAY_MODEL_URL", server.base_url)
    monkeypatch.setattr(get_config(), "WORKSPACE_ROOT", tmp_path / "workspaces")
    yield "replay:gov_marker"
    server.should_exit = True
    thread.join(timeout=5)
