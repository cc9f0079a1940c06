"""Django settings. Every value that varies by deployment comes from
:mod:`yuxi_project.config`, which validates the environment."""

from __future__ import annotations

import dj_database_url

from .config import BASE_DIR, get_config

CONFIG = get_config()

SECRET_KEY = CONFIG.SECRET_KEY
DEBUG = CONFIG.DEBUG
ALLOWED_HOSTS = CONFIG.ALLOWED_HOSTS

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
]

MIDDLEWARE = [
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
    _db.setdefault("OPTIONS", {})["pool"] = {"min_size": 1, "max_size": 8, "timeout": CONFIG.DB_POOL_TIMEOUT_SECONDS}
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
STATICFILES_DIRS = [BASE_DIR / "static"] if (BASE_DIR / "static").is_dir() else []
# WhiteNoise finds files where the staticfiles finders do, so neither the
# quick start nor the tests need a `collectstatic` step.
WHITENOISE_USE_FINDERS = True

LOGIN_URL = "/admin/login/"

# --- Celery -----------------------------------------------------------------
if CONFIG.REDIS_URL:
    CELERY_BROKER_URL = CONFIG.REDIS_URL
    CELERY_TASK_ALWAYS_EAGER = False
else:
    # Embedded defaults: no broker; tasks run in-process (see
    # audit.dispatch). Said plainly in the README.
    CELERY_BROKER_URL = "memory://"
    CELERY_TASK_ALWAYS_EAGER = True
CELERY_TASK_DEFAULT_QUEUE = CONFIG.CELERY_QUEUE
# A task is acknowledged only after it ran, so a crashed worker's task is
# delivered again; the lease makes the second delivery harmless (R-RUN-3).
CELERY_TASK_ACKS_LATE = True
CELERY_TASK_REJECT_ON_WORKER_LOST = True
CELERY_WORKER_PREFETCH_MULTIPLIER = 1
CELERY_TASK_IGNORE_RESULT = True
CELERY_BROKER_CONNECTION_RETRY_ON_STARTUP = True
CELERY_WORKER_HIJACK_ROOT_LOGGER = False
# The lease sweeper (R-RUN-7). Run beat once per deployment (`celery -A
# yuxi_project beat`, or `worker -B` on one worker); several beats are
# harmless: the sweep claims runs with SKIP LOCKED.
CELERY_BEAT_SCHEDULE = {
    "sweep-expired-leases": {
        "task": "audit.sweep_expired_leases",
        "schedule": CONFIG.LEASE_SWEEP_INTERVAL_SECONDS,
        "options": {"expires": CONFIG.LEASE_SWEEP_INTERVAL_SECONDS},
    },
}
# The schedule is one fixed interval task, so beat keeps it in memory: the
# default shelve-backed scheduler adds a state file per beat and, on Python
# 3.13 (dbm.sqlite3), can die at start-up, silently stopping the sweeper.
CELERY_BEAT_SCHEDULER = "celery.beat:Scheduler"

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {"plain": {"format": "%(asctime)s %(levelname)s %(name)s %(message)s"}},
    "handlers": {"console": {"class": "logging.StreamHandler", "formatter": "plain"}},
    "root": {"handlers": ["console"], "level": "INFO"},
    "loggers": {"httpx": {"level": "WARNING"}, "openai": {"level": "WARNING"}},
}
