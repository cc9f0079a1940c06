"""Production settings (R-SEC-1): the web server and the workers refuse the
public SECRET_KEY with DEBUG off; HTTPS comes from the environment, and the
documented production environment passes ``manage.py check --deploy``;
every page carries a Content Security Policy."""

from __future__ import annotations

import os
import re
import secrets
import subprocess
import sys

import pytest
from django.test import Client
from django.urls import reverse

from core.config import BASE_DIR, INSECURE_SECRET_KEY, Config, ConfigError, get_config, proxy_ssl_header
from yuxi_project.deploy_guard import UnsafeSettings, ensure_safe_settings

OPERATING = BASE_DIR / "docs" / "operating.md"


def documented_production_env() -> dict[str, str]:
    """The ``ini`` block under "Production settings" in docs/operating.md,
    a placeholder (``<…>``) given a value of its kind."""
    text = OPERATING.read_text(encoding="utf-8")
    section = text[text.index("## Production settings") :]
    block = re.search(r"```ini\n(.*?)```", section, flags=re.DOTALL)
    assert block, "docs/operating.md: no ini block under Production settings"
    env = {}
    for line in block.group(1).splitlines():
        name, _, value = line.partition("=")
        env[name.strip()] = secrets.token_urlsafe(50) if value.startswith("<") else value
    return env


def _manage(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if k not in {"SECRET_KEY", "DEBUG"}}
    return subprocess.run(
        [sys.executable, "manage.py", *args],
        cwd=BASE_DIR,
        env={**clean, "PYTHONWARNINGS": "ignore", **env},
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_the_documented_production_environment_passes_check_deploy_R_SEC_1():
    env = documented_production_env()
    assert {"SECRET_KEY", "SECURE_SSL_REDIRECT", "SECURE_HSTS_SECONDS", "CSRF_TRUSTED_ORIGINS"} <= set(env)
    done = _manage("check", "--deploy", "--fail-level", "WARNING", env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "no issues" in done.stdout, done.stdout
    # And without it, Django's own check names what is missing: the test
    # above is not green by accident.
    bare = _manage("check", "--deploy", "--fail-level", "WARNING", env={})
    assert bare.returncode != 0
    for warning in ("security.W004", "security.W008", "security.W009", "security.W012", "security.W016"):
        assert warning in bare.stderr + bare.stdout, warning


@pytest.mark.parametrize("entry_point", ["yuxi_project.asgi", "yuxi_project.wsgi"])
def test_the_web_server_refuses_to_start_on_the_public_key_with_debug_off_R_SEC_1(entry_point):
    """The ASGI entry point, as uvicorn imports it, and the WSGI one
    (runserver's): one line, no traceback, exit status 1, before the
    database is touched."""
    probe = f"import {entry_point}"
    env = {k: v for k, v in os.environ.items() if k not in {"SECRET_KEY", "DEBUG"}}
    done = subprocess.run(
        [sys.executable, "-c", probe],
        cwd=BASE_DIR,
        env={**env, "PYTHONWARNINGS": "ignore", "DATABASE_URL": "postgres://nobody@127.0.0.1:1/none"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 1
    assert done.stderr.startswith("refusing to start: SECRET_KEY is the public default while DEBUG is off")
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr


@pytest.mark.parametrize(
    ("debug", "key", "refused"),
    [
        (False, INSECURE_SECRET_KEY, True),
        (True, INSECURE_SECRET_KEY, False),
        (False, "k" * 20 + secrets.token_urlsafe(40), False),
    ],
)
def test_the_guard_refuses_only_the_public_key_with_debug_off_R_SEC_1(settings, debug, key, refused):
    settings.DEBUG, settings.SECRET_KEY = debug, key
    if refused:
        with pytest.raises(UnsafeSettings, match="SECRET_KEY is the public default"):
            ensure_safe_settings()
    else:
        ensure_safe_settings()


def test_a_celery_worker_refuses_to_start_on_the_public_key_R_SEC_1(settings, capsys):
    from yuxi_project.celery import refuse_mismatched_schema

    settings.DEBUG, settings.SECRET_KEY = False, INSECURE_SECRET_KEY
    with pytest.raises(SystemExit) as stopped:
        refuse_mismatched_schema(sender=None)
    assert stopped.value.code == 1
    assert "SECRET_KEY is the public default" in capsys.readouterr().err


def test_https_settings_come_from_the_environment_and_bad_values_are_refused_R_SEC_1(monkeypatch):
    assert proxy_ssl_header("X-Forwarded-Proto: https") == ("HTTP_X_FORWARDED_PROTO", "https")
    assert proxy_ssl_header("X-Forwarded-Proto https") is None
    for name, value in documented_production_env().items():
        monkeypatch.setenv(name, value)
    config = Config()
    assert config.SECURE_SSL_REDIRECT and config.SESSION_COOKIE_SECURE and config.CSRF_COOKIE_SECURE
    assert config.SECURE_HSTS_SECONDS == 31536000 and config.CSRF_TRUSTED_ORIGINS == ["https://audit.example.com"]
    for name, bad in (
        ("SECURE_PROXY_SSL_HEADER", "https"),
        ("CSRF_TRUSTED_ORIGINS", "audit.example.com"),
        ("CSRF_TRUSTED_ORIGINS", "https://audit.example.com/admin/"),
        ("SECURE_HSTS_SECONDS", "-1"),
    ):
        with monkeypatch.context() as patched:
            patched.setenv(name, bad)
            with pytest.raises(ConfigError, match=name):
                get_config.__wrapped__()  # read anew, not the process's cached one


def test_https_redirect_hsts_and_secure_cookies_behind_the_proxy_R_SEC_1(client, settings, staff_user):
    settings.SECURE_SSL_REDIRECT = True
    settings.SECURE_PROXY_SSL_HEADER = ("HTTP_X_FORWARDED_PROTO", "https")
    settings.SECURE_HSTS_SECONDS = 300
    settings.SESSION_COOKIE_SECURE = settings.CSRF_COOKIE_SECURE = True
    plain = client.get("/admin/login/")
    assert plain.status_code == 301 and plain["Location"].startswith("https://")
    assert client.get("/healthz").status_code == 200, "probes are not redirected"
    over_https = client.get("/admin/login/", headers={"x-forwarded-proto": "https"})
    assert over_https.status_code == 200 and over_https["Strict-Transport-Security"] == "max-age=300"
    assert over_https.cookies["csrftoken"]["secure"]
    signed_in = client.post(
        "/admin/login/",
        {"username": staff_user.username, "password": "pw-12345678", "next": "/admin/"},
        headers={"x-forwarded-proto": "https"},
    )
    assert signed_in.status_code == 302 and signed_in.cookies["sessionid"]["secure"]


@pytest.mark.parametrize("path", ["/admin/login/", "/api/docs", "/admin/", "/chat/", "/chat/login/"])
def test_every_page_carries_a_content_security_policy_R_SEC_1(client, staff_user, path):
    client.force_login(staff_user)
    policy = client.get(path)["Content-Security-Policy"]
    directives = dict(part.strip().split(" ", 1) for part in policy.split(";"))
    assert directives["script-src"] == "'self'", "no inline script, no other origin"
    assert directives["frame-ancestors"] == "'none'" and directives["object-src"] == "'none'"
    assert directives["default-src"] == "'self'"


def test_redirects_and_errors_carry_the_policy_too_R_SEC_1(client, settings):
    """The HTTPS redirect (answered by SecurityMiddleware before any view),
    the sign-in and slash redirects, a 404, a 405 and the API's JSON errors
    all carry the same policy as the pages."""
    page_policy = client.get("/admin/login/")["Content-Security-Policy"]
    answers = [
        client.get("/admin/"),  # 302 to the sign-in
        client.get("/admin"),  # 301 to /admin/
        client.get("/no-such-page/"),
        client.get("/chat/logout/"),  # 405
        client.get("/api/threads"),  # 401, JSON
        client.get("/api/no-such-endpoint"),  # 404, JSON
    ]
    settings.SECURE_SSL_REDIRECT = True
    answers.append(Client().get("/admin/login/"))  # a new client loads the middleware anew
    assert [a.status_code for a in answers] == [302, 301, 404, 405, 401, 404, 301]
    for answer in answers:
        assert answer.get("Content-Security-Policy") == page_policy, answer


def test_the_admin_pages_use_no_inline_script_R_SEC_1(client, staff_user, thread):
    """What the policy forbids is not used: no ``<script>`` with a body in
    the admin pages the product adds (the browser test watches for
    violations in Chromium)."""
    from tests.read.builders import tool_turn

    run = tool_turn(thread)
    client.force_login(staff_user)
    for url in (
        reverse("admin:audit_agentrun_change", args=[run.pk]),
        reverse("admin:conversations_conversation_change", args=[thread.pk]),
        reverse("admin-dashboard"),
        "/api/docs",
        "/chat/",
    ):
        page = client.get(url).content.decode()
        bodies = re.findall(r"<script(?![^>]*\bsrc=)(?![^>]*type=\"application/json\")[^>]*>(.*?)</script>", page, re.S)
        assert [body for body in bodies if body.strip()] == [], url
