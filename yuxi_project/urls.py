from django.contrib import admin
from django.http import HttpResponsePermanentRedirect
from django.templatetags.static import static
from django.urls import include, path

from dashboard.views import dashboard_page
from ops.views import healthz, metrics_view, readyz

from .api import api

# The run and message lists need the width at 1280 px (R-ADM-2): no
# navigation sidebar beside them (the index and breadcrumbs navigate).
admin.site.enable_nav_sidebar = False
# The admin's "View site" link opens the chat (R-UI-1).
admin.site.site_url = "/chat/"


def favicon(request):
    """``/favicon.ico``, which browsers ask for on pages that name no icon
    (the API's docs): the product's icon, a static SVG."""
    return HttpResponsePermanentRedirect(static("yuxi/favicon.svg"))


urlpatterns = [
    # Before admin.site.urls, whose catch-all would answer 404 (R-DASH-1).
    path("admin/dashboard/", admin.site.admin_view(dashboard_page), name="admin-dashboard"),
    path("admin/", admin.site.urls),
    path("api/", api.urls),
    # The chat page for signed-in users (R-UI-1).
    path("chat/", include("chat.urls")),
    # Operations (R-OPS-1): Prometheus scrape, liveness, readiness.
    path("metrics", metrics_view, name="metrics"),
    path("healthz", healthz, name="healthz"),
    path("readyz", readyz, name="readyz"),
    path("favicon.ico", favicon, name="favicon"),
]
