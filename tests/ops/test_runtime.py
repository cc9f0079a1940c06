"""The web server's process tuning (issue 11): once the application is
loaded, its objects are frozen out of the garbage collector's sight and the
young generation collects less often, which cut the slow tail of the large
read pages."""

from __future__ import annotations

import os
import subprocess
import sys
from urllib.parse import quote

import pytest
from django.db import connection

from yuxi_project.runtime import GC_THRESHOLDS

PROBE = "import gc, yuxi_project.{entry}; print(gc.get_threshold(), gc.get_freeze_count() > 10_000)"


@pytest.mark.django_db
@pytest.mark.parametrize("entry", ["asgi", "wsgi"])
def test_the_web_entry_points_tune_the_collector_once_the_application_is_loaded(entry):
    settings = connection.settings_dict
    login = settings["USER"] + (f":{quote(settings['PASSWORD'], safe='')}" if settings.get("PASSWORD") else "")
    env = {
        **os.environ,
        "DATABASE_URL": f"postgres://{login}@{settings['HOST']}:{settings['PORT']}/{settings['NAME']}",
        "DJANGO_SETTINGS_MODULE": "yuxi_project.settings",
    }
    done = subprocess.run(
        [sys.executable, "-c", PROBE.format(entry=entry)], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == f"{GC_THRESHOLDS} True"
