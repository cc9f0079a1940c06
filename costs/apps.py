from django.apps import AppConfig


class CostsConfig(AppConfig):
    name = "costs"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        from celery.signals import worker_init

        from .pricing import warm_up

        # The price catalogue is a large Python module: import it once in
        # the worker's parent process (its pool children inherit it), not
        # during the first model call of a run, where it would hold up the
        # audit thread that also renews the lease.
        worker_init.connect(lambda **_: warm_up(), weak=False)
