from django.db import migrations, models


def move_seq_out_of_metadata(apps, schema_editor):
    """Saves used to keep their seq_id in the client's metadata under ``_seq`` and hid every
    key starting with '_' when reading it back; the seq_id now has a column of its own."""
    Checkpoint = apps.get_model("tinker_api", "Checkpoint")
    for ckpt in Checkpoint.objects.filter(user_metadata__has_key="_seq").iterator():
        meta = dict(ckpt.user_metadata)
        seq = meta.pop("_seq")
        try:
            ckpt.seq = int(seq)
        except (TypeError, ValueError):
            ckpt.seq = None
        ckpt.user_metadata = meta or None
        ckpt.save(update_fields=["seq", "user_metadata"])


def move_seq_back(apps, schema_editor):
    Checkpoint = apps.get_model("tinker_api", "Checkpoint")
    for ckpt in Checkpoint.objects.filter(seq__isnull=False).iterator():
        ckpt.user_metadata = {**(ckpt.user_metadata or {}), "_seq": str(ckpt.seq)}
        ckpt.save(update_fields=["user_metadata"])


class Migration(migrations.Migration):
    dependencies = [
        ("tinker_api", "0003_session_display_name"),
    ]

    operations = [
        migrations.AddField(
            model_name="checkpoint",
            name="seq",
            field=models.BigIntegerField(blank=True, null=True),
        ),
        migrations.RunPython(move_seq_out_of_metadata, move_seq_back),
    ]
