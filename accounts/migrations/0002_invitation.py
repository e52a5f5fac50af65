"""Invitations move from the web app to accounts, with the rest of team state.

State only: the table keeps its name (``web_invitation``) and its rows; web's 0002 drops the
model from web's state after this one adds it here.
"""

import django.db.models.deletion
from django.conf import settings
from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("accounts", "0001_initial"),
        ("web", "0001_initial"),
        migrations.swappable_dependency(settings.AUTH_USER_MODEL),
    ]

    operations = [
        migrations.SeparateDatabaseAndState(
            state_operations=[
                migrations.CreateModel(
                    name="Invitation",
                    fields=[
                        (
                            "id",
                            models.BigAutoField(
                                auto_created=True,
                                primary_key=True,
                                serialize=False,
                                verbose_name="ID",
                            ),
                        ),
                        ("email", models.EmailField(max_length=254)),
                        ("role", models.CharField(default="member", max_length=16)),
                        ("created", models.DateTimeField(auto_now_add=True)),
                        ("accepted", models.DateTimeField(blank=True, null=True)),
                        (
                            "invited_by",
                            models.ForeignKey(
                                null=True,
                                on_delete=django.db.models.deletion.SET_NULL,
                                related_name="+",
                                to=settings.AUTH_USER_MODEL,
                            ),
                        ),
                        (
                            "team",
                            models.ForeignKey(
                                on_delete=django.db.models.deletion.CASCADE,
                                related_name="invitations",
                                to="accounts.team",
                            ),
                        ),
                    ],
                    options={
                        "db_table": "web_invitation",
                        "ordering": ["-created"],
                        "constraints": [
                            models.UniqueConstraint(
                                fields=("team", "email"), name="invitation_team_email_unique"
                            )
                        ],
                    },
                ),
            ],
            database_operations=[],
        ),
    ]
