"""Django settings. Every value that varies by deployment comes from
:mod:`core.config`, which validates the environment."""

from __future__ import annotations

import contextlib
import ssl
from urllib.parse import parse_qs, urlsplit

import dj_database_url
from django.utils.csp import CSP

from core.config import BASE_DIR, get_config, proxy_ssl_header
from core.pool import pool_check_connection

CONFIG = get_config()

SECRET_KEY = CONFIG.SECRET_KEY
DEBUG = CONFIG.DEBUG
ALLOWED_HOSTS = CONFIG.ALLOWED_HOSTS

# HTTPS (R-SEC-1): from the environment; docs/operating.md lists the
# production set, with which `manage.py check --deploy` passes.
SECURE_SSL_REDIRECT = CONFIG.SECURE_SSL_REDIRECT
SECURE_PROXY_SSL_HEADER = proxy_ssl_header(CONFIG.SECURE_PROXY_SSL_HEADER) if CONFIG.SECURE_PROXY_SSL_HEADER else None
SECURE_HSTS_SECONDS = CONFIG.SECURE_HSTS_SECONDS
SECURE_HSTS_INCLUDE_SUBDOMAINS = CONFIG.SECURE_HSTS_INCLUDE_SUBDOMAINS
SECURE_HSTS_PRELOAD = CONFIG.SECURE_HSTS_PRELOAD
SESSION_COOKIE_SECURE = CONFIG.SESSION_COOKIE_SECURE
CSRF_COOKIE_SECURE = CONFIG.CSRF_COOKIE_SECURE
CSRF_TRUSTED_ORIGINS = CONFIG.CSRF_TRUSTED_ORIGINS
# The scrape and the probes answer over plain HTTP inside the network
# (Prometheus and the orchestrator reach the pod, not the public name).
SECURE_REDIRECT_EXEMPT = [r"^(metrics|healthz|readyz)$"]

# Content Security Policy on every page (R-SEC-1): scripts and styles only
# from this site's static files (the admin, the dashboard's Chart.js, the
# API docs' Swagger UI are all served from here, no CDN); inline style
# attributes stay allowed (the timeline's bars and Django's admin set
# them), inline scripts never.
SECURE_CSP = {
    "default-src": [CSP.SELF],
    "script-src": [CSP.SELF],
    "style-src": [CSP.SELF, CSP.UNSAFE_INLINE],
    "img-src": [CSP.SELF, "data:"],
    "font-src": [CSP.SELF, "data:"],
    "connect-src": [CSP.SELF],
    "object-src": [CSP.NONE],
    "base-uri": [CSP.NONE],
    "form-action": [CSP.SELF],
    "frame-ancestors": [CSP.NONE],
}

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    # Listed so that /api/docs serves Swagger UI from ninja's own static
    # files instead of a CDN (works offline).
    "ninja",
    "conversations",
    "audit",
    "dashboard",
    "costs",
    "otel_export",
    # Operations (R-OPS-1): metrics, health; its command renders the
    # configuration reference from code (config_reference).
    "ops",
    # The benchmarks' commands (bench_*, performance_report); no model.
    "benchmarks",
    # Append-only audit triggers declared on the models (R-GOV-3).
    "pgtrigger",
    "governance",
    # Run ends announced to webhooks (R-API-3).
    "webhooks",
    # The chat page (R-UI-1): views, template and static script; no model.
    "chat",
]

MIDDLEWARE = [
    # First, so every line logged for the request carries its id (R-OPS-1).
    "ops.middleware.RequestContextMiddleware",
    # Before SecurityMiddleware, whose HTTPS redirect answers early: every
    # response carries the policy, redirects included (R-SEC-1).
    "django.middleware.csp.ContentSecurityPolicyMiddleware",
    "django.middleware.security.SecurityMiddleware",
    # Serves admin CSS/JS and the vendored chart library from the ASGI
    # process itself (uvicorn has no static file handler).
    "whitenoise.middleware.WhiteNoiseMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
    # Unknown /api/ paths and methods answer the API's JSON error shape.
    "yuxi_project.middleware.ApiJsonErrorsMiddleware",
]

ROOT_URLCONF = "yuxi_project.urls"
ASGI_APPLICATION = "yuxi_project.asgi.application"
# Also what `manage.py runserver` loads; both entry points run the schema
# guard (R-SCH-1).
WSGI_APPLICATION = "yuxi_project.wsgi.application"

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [BASE_DIR / "templates"],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ],
        },
    },
]

# PostgreSQL is the store every guarantee is promised on. Without
# DATABASE_URL the quick start falls back to SQLite (embedded defaults).
EMBEDDED = not CONFIG.DATABASE_URL or not CONFIG.REDIS_URL
if CONFIG.DATABASE_URL and not CONFIG.DATABASE_URL.startswith("sqlite"):
    _db = dj_database_url.parse(CONFIG.DATABASE_URL)
    # A connection pool: closing a connection after each short audit
    # transaction hands it back to the pool instead of tearing it down
    # (R-RUN-5). CONN_MAX_AGE must be 0 with the pool.
    _db["CONN_MAX_AGE"] = 0
    # The pool checks a connection before handing it out, so connections
    # that died in a PostgreSQL restart are replaced instead of failing the
    # next request or audit write (one empty round trip per checkout).
    _db["CONN_HEALTH_CHECKS"] = True
    _db.setdefault("OPTIONS", {})["pool"] = {
        "min_size": 1,
        "max_size": 8,
        "timeout": CONFIG.DB_POOL_TIMEOUT_SECONDS,
        # Checks without a round trip unless the server ended the connection.
        "check": pool_check_connection,
    }
    if CONFIG.DB_PREPARED_STATEMENTS:
        # Django turns psycopg's prepared statements off (prepare_threshold
        # None), and then psycopg ignores even an explicit ``prepare=True``.
        # A threshold no ORM query reaches keeps the ORM's queries unprepared
        # while the audit writes that ask for it (audit.ledger.fenced) are
        # prepared once per connection: planning was half of a write's time.
        _db["OPTIONS"]["prepare_threshold"] = 2**31 - 1
        # And planned once: PostgreSQL otherwise keeps planning a prepared
        # statement anew whenever its plan for the values looks cheaper than
        # the plan for any values, and did so on every call of the model
        # row's open (its budget condition): 0.9 ms of planning for 0.2 ms
        # of execution, twice a run (issue 11). The statements prepared here
        # find rows by their keys (a run, a row, a thread), whose plan does
        # not depend on the values. Only prepared statements are concerned:
        # the ORM's are sent with their values.
        _existing = _db["OPTIONS"].get("options", "")
        _db["OPTIONS"]["options"] = f"{_existing} -c plan_cache_mode=force_generic_plan".strip()
    _db["TEST"] = {"NAME": _db["NAME"] + "_test"}
    DATABASES = {"default": _db}
elif CONFIG.DATABASE_URL:
    DATABASES = {"default": dj_database_url.parse(CONFIG.DATABASE_URL)}
else:
    (BASE_DIR / "var").mkdir(exist_ok=True)
    DATABASES = {
        "default": {
            "ENGINE": "django.db.backends.sqlite3",
            "NAME": BASE_DIR / "var" / "yuxi.sqlite3",
            "OPTIONS": {"timeout": 20, "transaction_mode": "IMMEDIATE"},
        }
    }

DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

AUTH_PASSWORD_VALIDATORS = [
    {"NAME": "django.contrib.auth.password_validation.MinimumLengthValidator"},
]

LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
USE_I18N = True
USE_TZ = True

STATIC_URL = "static/"
STATIC_ROOT = BASE_DIR / "var" / "static"
# collectstatic's target; WhiteNoise warns at every start while it does not
# exist, though it serves through the finders below without it.
with contextlib.suppress(OSError):
    STATIC_ROOT.mkdir(parents=True, exist_ok=True)
STATICFILES_DIRS = [BASE_DIR / "static"] if (BASE_DIR / "static").is_dir() else []
# WhiteNoise finds files where the staticfiles finders do, so neither the
# quick start nor the tests need a `collectstatic` step.
WHITENOISE_USE_FINDERS = True

LOGIN_URL = "/admin/login/"

# --- Celery -----------------------------------------------------------------
if CONFIG.REDIS_URL:
    CELERY_BROKER_URL = CONFIG.REDIS_URL
    CELERY_TASK_ALWAYS_EAGER = False
    # kombu's Redis transport, except that losing Redis while runs hold
    # unacknowledged messages does not end the worker (see the module).
    CELERY_BROKER_TRANSPORT = "yuxi_project.broker:Transport"
    _broker_url = urlsplit(CONFIG.REDIS_URL)
    if _broker_url.scheme == "rediss" and not any(key.startswith("ssl_") for key in parse_qs(_broker_url.query)):
        # A rediss:// URL without ssl_* options verifies the server's
        # certificate, as redis-py does for the live events and cancel
        # signals on the same URL (kombu alone would fall back to no
        # verification). Add ``?ssl_cert_reqs=none`` to the URL to opt out.
        CELERY_BROKER_USE_SSL = {"ssl_cert_reqs": ssl.CERT_REQUIRED}
else:
    # Embedded defaults: no broker; tasks run in-process (see
    # audit.execution.dispatch). Said plainly in the README.
    CELERY_BROKER_URL = "memory://"
    CELERY_TASK_ALWAYS_EAGER = True
CELERY_TASK_DEFAULT_QUEUE = CONFIG.CELERY_QUEUE
# At-least-once delivery; PostgreSQL, not the broker, is the source of truth
# for what must run (R-RUN-9): the dispatcher re-enqueues any pending run
# whose message is lost, and the lease makes every duplicate harmless
# (R-RUN-3). Each choice below says why.
#
# Acknowledge a task only after it ran, so a worker that dies mid-run does
# not take the message with it.
CELERY_TASK_ACKS_LATE = True
# A pool process killed (SIGKILL, OOM) hands its message back at once
# instead of acking it as failed; the redelivery finds the run leased or
# swept and starts nothing twice.
CELERY_TASK_REJECT_ON_WORKER_LOST = True
# One message per free slot: a busy worker does not sit on messages another
# worker could start.
CELERY_WORKER_PREFETCH_MULTIPLIER = 1
# Celery's consumer without Mingle and Gossip, which the product does not
# use and which reports implicate in workers that stop consuming after Redis
# flapped (see the module).
CELERY_WORKER_CONSUMER = "yuxi_project.broker:Consumer"
CELERY_TASK_IGNORE_RESULT = True
# Reconnect to the broker forever, at start-up and after losing it: a Redis
# restart must not end the worker (finding: broker restarted empty).
CELERY_BROKER_CONNECTION_RETRY_ON_STARTUP = True
CELERY_BROKER_CONNECTION_RETRY = True
CELERY_BROKER_CONNECTION_MAX_RETRIES = None
# Runs keep going when the broker goes away: their lease lives in
# PostgreSQL, and cancelling them would throw work away.
CELERY_WORKER_CANCEL_LONG_RUNNING_TASKS_ON_CONNECTION_LOSS = False
CELERY_BROKER_TRANSPORT_OPTIONS = {
    # Redis redelivers an unacked message after this long. It is only a
    # last resort (the dispatcher re-enqueues a lost run within
    # DISPATCH_GRACE_SECONDS) and must stay well above the lease TTL and a
    # long run's duration, or live runs get redundant duplicates.
    "visibility_timeout": max(3600, int(CONFIG.LEASE_TTL_SECONDS * 10)),
    # A dead or frozen Redis fails a publish in seconds, not minutes: the
    # submission has committed and answers 202 either way.
    "socket_connect_timeout": 3,
    "socket_timeout": 10,
    "retry_on_timeout": True,
    "health_check_interval": 10,
}
# Publishing (submit, dispatcher) retries briefly, then gives up: the run
# is in PostgreSQL and the dispatcher hands it over later (R-RUN-9).
CELERY_TASK_PUBLISH_RETRY = True
CELERY_TASK_PUBLISH_RETRY_POLICY = {"max_retries": 2, "interval_start": 0, "interval_step": 0.2, "interval_max": 0.5}
CELERY_WORKER_HIJACK_ROOT_LOGGER = False
# The dispatcher (R-RUN-9) and the lease sweeper (R-RUN-7) go to their own
# queue, consumed by its own worker (`celery -A yuxi_project worker -Q
# agent-maintenance`), so that run workers with every slot busy cannot
# starve them. Run beat once per deployment (`celery -A yuxi_project
# beat`); several beats are harmless: both claim rows with SKIP LOCKED.
# A message that waited for several intervals is dropped: the next one
# does the same work.
CELERY_BEAT_SCHEDULE = {
    "sweep-expired-leases": {
        "task": "audit.sweep_expired_leases",
        "schedule": CONFIG.LEASE_SWEEP_INTERVAL_SECONDS,
        "options": {
            "queue": CONFIG.CELERY_MAINTENANCE_QUEUE,
            "expires": max(30.0, 5 * CONFIG.LEASE_SWEEP_INTERVAL_SECONDS),
        },
    },
    "dispatch-runs": {
        "task": "audit.dispatch_runs",
        "schedule": CONFIG.DISPATCH_INTERVAL_SECONDS,
        "options": {
            "queue": CONFIG.CELERY_MAINTENANCE_QUEUE,
            "expires": max(30.0, 5 * CONFIG.DISPATCH_INTERVAL_SECONDS),
        },
    },
    # Deleted threads whose erasure waited for their runs to end (R-API-1).
    "erase-deleted-threads": {
        "task": "governance.erase_deleted_threads",
        "schedule": 60.0,
        "options": {"queue": CONFIG.CELERY_MAINTENANCE_QUEUE, "expires": 60.0},
    },
}
# OpenTelemetry export of closed runs (R-OTEL-1), on its own queue so a slow
# receiver never delays agent runs: a worker must consume it (`-Q
# otel-export`). Only scheduled when an endpoint is configured.
if CONFIG.OTEL_EXPORTER_OTLP_ENDPOINT:
    CELERY_BEAT_SCHEDULE["export-otel"] = {
        "task": "otel_export.export",
        "schedule": CONFIG.OTEL_EXPORT_INTERVAL_SECONDS,
        "options": {"queue": CONFIG.OTEL_EXPORT_QUEUE, "expires": CONFIG.OTEL_EXPORT_INTERVAL_SECONDS},
    }
# Webhook deliveries (R-API-3), on their own queue so a slow receiver never
# delays agent runs or the sweeper: a worker must consume it (`-Q
# webhooks`). Only scheduled when hosts are allowed.
if CONFIG.WEBHOOK_ALLOWED_HOSTS:
    CELERY_BEAT_SCHEDULE["deliver-webhooks"] = {
        "task": "webhooks.deliver",
        "schedule": CONFIG.WEBHOOK_INTERVAL_SECONDS,
        "options": {"queue": CONFIG.WEBHOOK_QUEUE, "expires": max(30.0, 5 * CONFIG.WEBHOOK_INTERVAL_SECONDS)},
    }
# Retention (R-GOV-1): the periodic purge of old payloads, on the
# maintenance queue; only scheduled when RETENTION_DAYS is set.
if CONFIG.RETENTION_DAYS is not None:
    CELERY_BEAT_SCHEDULE["purge-payloads"] = {
        "task": "governance.purge_payloads",
        "schedule": CONFIG.RETENTION_PURGE_INTERVAL_SECONDS,
        "options": {"queue": CONFIG.CELERY_MAINTENANCE_QUEUE, "expires": CONFIG.RETENTION_PURGE_INTERVAL_SECONDS},
    }
# Signed digests (R-GOV-5): every minute the due ones are published; only
# scheduled when a digest key is set.
if CONFIG.AUDIT_SIGNING_KEY or CONFIG.AUDIT_SIGNING_KEY_FILE:
    CELERY_BEAT_SCHEDULE["publish-digests"] = {
        "task": "governance.publish_digests",
        "schedule": 60.0,
        "options": {"queue": CONFIG.CELERY_MAINTENANCE_QUEUE, "expires": 60.0},
    }
# The schedule is one fixed interval task, so beat keeps it in memory: the
# default shelve-backed scheduler adds a state file per beat and, on Python
# 3.13 (dbm.sqlite3), can die at start-up, silently stopping the sweeper.
CELERY_BEAT_SCHEDULER = "celery.beat:Scheduler"

# LOG_FORMAT=json: one JSON object per line; every line carries run_id,
# thread_id, request_id and worker (ops.logcontext, R-OPS-1).
LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "filters": {"context": {"()": "ops.logcontext.ContextFilter"}},
    "formatters": {
        "plain": {"format": "%(asctime)s %(levelname)s %(name)s %(message)s"},
        "json": {"()": "ops.logcontext.json_formatter"},
    },
    "handlers": {"console": {"class": "logging.StreamHandler", "formatter": CONFIG.LOG_FORMAT, "filters": ["context"]}},
    "root": {"handlers": ["console"], "level": "INFO"},
    "loggers": {"httpx": {"level": "WARNING"}, "openai": {"level": "WARNING"}},
}
