"""Teams made before every creation path made a quota row get one now, so that reading a
quota (``GET /api/v1/quota``) never has to write."""

from django.db import migrations


def add_missing_quotas(apps, schema_editor):
    Team = apps.get_model("accounts", "Team")
    Quota = apps.get_model("accounts", "Quota")
    missing = Team.objects.filter(quota__isnull=True).values_list("pk", flat=True)
    Quota.objects.bulk_create([Quota(team_id=pk) for pk in missing])


class Migration(migrations.Migration):
    dependencies = [("accounts", "0002_invitation")]

    operations = [migrations.RunPython(add_missing_quotas, migrations.RunPython.noop)]
