"""The body a webhook delivers (R-API-3): the run as ``GET
/api/runs/{run_id}`` answers it."""

from __future__ import annotations

from audit.schemas import RunOut
from yuxi_project.responses import encode_json


def run_body(run) -> bytes:
    """``run`` (an :class:`~audit.models.AgentRun`) as the JSON bytes of
    :class:`~audit.schemas.RunOut`, encoded as the API encodes it."""
    return encode_json(RunOut.from_run(run).model_dump())
