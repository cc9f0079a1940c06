"""ASGI entry point: ``uvicorn yuxi_project.asgi:application``."""

import os

from django.core.asgi import get_asgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "yuxi_project.settings")

application = get_asgi_application()
