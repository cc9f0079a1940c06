"""The chat page (R-UI-1) and its sign-in.

The page is a template and ``static/chat/chat.js``: the script does every
read and write through the JSON API with the session cookie and the CSRF
token the page carries, and follows a run's live events with
``EventSource``. The Content Security Policy allows scripts from this
origin only, so the page's data (models, the default model, the agent) is
rendered with ``json_script``, which the browser never executes.
"""

from __future__ import annotations

from django.contrib.auth import views as auth_views
from django.contrib.auth.decorators import login_required
from django.template.response import TemplateResponse
from django.urls import reverse_lazy
from django.views.decorators.csrf import ensure_csrf_cookie

from audit.catalogue import chat_models
from core.config import get_config

#: The agent a new thread runs (the bundled assistant).
CHAT_AGENT_ID = "assistant"

template_name = "chat/index.html"
login_template_name = "chat/login.html"


@login_required(login_url=reverse_lazy("chat:login"))
@ensure_csrf_cookie
def chat_page(request):
    """``GET /chat/``: the signed-in user's threads and conversation.

    Anonymous visitors are sent to :func:`chat_login` with ``next``. The
    model select offers the models meant for a person to try
    (:func:`audit.catalogue.chat_models`: the chat's replay scenarios, each
    with its description, and ``MODELS``; no endpoint lists them), not
    every name ``POST /api/threads`` accepts, ``DEFAULT_MODEL`` chosen."""
    config = {
        "agent_id": CHAT_AGENT_ID,
        "models": chat_models(),
        "default_model": get_config().DEFAULT_MODEL,
    }
    return TemplateResponse(request, template_name, {"chat_config": config})


#: ``/chat/login/``: any active user signs in here. The admin's login form
#: refuses users who are not staff, and the chat is for every user.
chat_login = auth_views.LoginView.as_view(
    template_name=login_template_name,
    redirect_authenticated_user=True,
    next_page=reverse_lazy("chat:page"),
)

#: ``POST /chat/logout/`` (Django's logout is POST only), back to the sign-in.
chat_logout = auth_views.LogoutView.as_view(next_page=reverse_lazy("chat:login"))
