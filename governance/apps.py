from django.apps import AppConfig


class GovernanceConfig(AppConfig):
    name = "governance"
    verbose_name = "Data governance"
    default_auto_field = "django.db.models.BigAutoField"
