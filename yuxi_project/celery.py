"""The Celery application that runs agent runs (see ``audit.tasks``)."""

import os

from celery import Celery

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "yuxi_project.settings")

app = Celery("yuxi")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()
