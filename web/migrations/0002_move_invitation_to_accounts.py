"""The Invitation model now lives in accounts (its 0002 took over the same table)."""

from django.db import migrations


class Migration(migrations.Migration):
    dependencies = [
        ("web", "0001_initial"),
        ("accounts", "0002_invitation"),
    ]

    operations = [
        migrations.SeparateDatabaseAndState(
            state_operations=[migrations.DeleteModel(name="Invitation")],
            database_operations=[],
        ),
    ]
