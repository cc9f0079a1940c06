"""The chat page for signed-in users (R-UI-1): a Django template and one
static script over the JSON API (``/api/threads``, ``/api/runs``), no build
step and no framework."""
