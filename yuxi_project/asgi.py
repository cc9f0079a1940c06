"""ASGI entry point: ``uvicorn yuxi_project.asgi:application``.

Refuses to start with unsafe production settings (R-SEC-1,
:mod:`yuxi_project.deploy_guard`) or against a database whose schema does
not match the code (R-SCH-1, :mod:`yuxi_project.schema_guard`)."""

import os

from django.core.asgi import get_asgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "yuxi_project.settings")

application = get_asgi_application()

from yuxi_project.deploy_guard import ensure_safe_settings, start_or_exit  # noqa: E402
from yuxi_project.schema_guard import ensure_schema_matches  # noqa: E402

# One line and exit status 1 on a refusal, not a traceback.
start_or_exit(ensure_safe_settings, ensure_schema_matches)

from core.draining import DrainOnStop  # noqa: E402
from yuxi_project.runtime import tune_gc  # noqa: E402

# A stop signal ends the live event streams, so that the server's graceful
# shutdown does not wait for every followed run to end.
application = DrainOnStop(application)

# The loaded application is long-lived: out of the collector's way.
tune_gc()
