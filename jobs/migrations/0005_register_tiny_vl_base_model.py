"""Register the project's tiny vision-language model (models/tiny-vl), as 0003 does the chat
model: a fresh install can run vision jobs (the geometry env) without admin setup."""

from __future__ import annotations

from django.apps.registry import Apps
from django.db import migrations
from django.db.backends.base.schema import BaseDatabaseSchemaEditor

TINY_VL = {
    "path": "models/tiny-vl",
    "max_lora_rank": 64,
    "max_context": 1024,
    "enabled": True,
    "description": "The project's tiny vision-language model (Qwen2.5-VL architecture), built "
    "offline by scripts/build_tiny_vl_model.py.",
}


def register(apps: Apps, schema_editor: BaseDatabaseSchemaEditor) -> None:
    BaseModel = apps.get_model("jobs", "BaseModel")
    BaseModel.objects.using(schema_editor.connection.alias).get_or_create(
        name="tiny-vl", defaults=TINY_VL
    )


def unregister(apps: Apps, schema_editor: BaseDatabaseSchemaEditor) -> None:
    BaseModel = apps.get_model("jobs", "BaseModel")
    BaseModel.objects.using(schema_editor.connection.alias).filter(
        name="tiny-vl", path=TINY_VL["path"]
    ).delete()


class Migration(migrations.Migration):
    dependencies = [("jobs", "0004_job_cancel_requested_at")]

    operations = [migrations.RunPython(register, unregister)]
