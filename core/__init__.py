"""The foundation every app stands on: configuration (:mod:`core.config`),
the database bridge and its statements (:mod:`core.db`, :mod:`core.pool`),
the Redis client options (:mod:`core.redis_client`), content PostgreSQL
cannot store (:mod:`core.storable`, R-RUN-13), the one error family
(:mod:`core.errors`), the workspace's file layout (:mod:`core.workspace`)
and keyset cursors (:mod:`core.cursors`).

The bottom layer (docs/architecture.md#layers): it imports Django and the
libraries, never a module of the product's apps nor the Django project
(:mod:`yuxi_project`: settings, URLs, the API's wiring, the Celery app),
which sits at the top.
"""
