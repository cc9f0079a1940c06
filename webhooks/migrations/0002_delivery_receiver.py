from django.db import migrations, models


def fill_receivers(apps, schema_editor):
    """Deliveries queued before the column: their receiver from the URL."""
    from webhooks.targets import receiver_of

    Delivery = apps.get_model("webhooks", "WebhookDelivery")
    for delivery in Delivery.objects.exclude(url="").only("pk", "url").iterator():
        Delivery.objects.filter(pk=delivery.pk).update(receiver=receiver_of(delivery.url))


class Migration(migrations.Migration):
    dependencies = [
        ("webhooks", "0001_initial"),
    ]

    operations = [
        migrations.AddField(
            model_name="webhookdelivery",
            name="receiver",
            field=models.CharField(blank=True, default="", max_length=300),
        ),
        migrations.RunPython(fill_receivers, migrations.RunPython.noop),
    ]
