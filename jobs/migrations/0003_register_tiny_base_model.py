"""Register the project's tiny model so a fresh install can run jobs without admin setup.

The path is relative: ``BaseModel.resolved_path()`` resolves it against the project root at
run time, so the row stays right when the checkout moves. Values follow
scripts/build_tiny_model.py (hidden size 256, 1024 positions).
"""

from __future__ import annotations

from django.apps.registry import Apps
from django.db import migrations
from django.db.backends.base.schema import BaseDatabaseSchemaEditor

TINY = {
    "path": "models/tiny-chat",
    "max_lora_rank": 64,
    "max_context": 1024,
    "enabled": True,
    "description": "The project's tiny chat model, built offline by scripts/build_tiny_model.py.",
}


def register_tiny(apps: Apps, schema_editor: BaseDatabaseSchemaEditor) -> None:
    BaseModel = apps.get_model("jobs", "BaseModel")
    # get_or_create: never overwrite what an administrator changed.
    BaseModel.objects.using(schema_editor.connection.alias).get_or_create(
        name="tiny", defaults=TINY
    )


def unregister_tiny(apps: Apps, schema_editor: BaseDatabaseSchemaEditor) -> None:
    BaseModel = apps.get_model("jobs", "BaseModel")
    BaseModel.objects.using(schema_editor.connection.alias).filter(
        name="tiny", path=TINY["path"]
    ).delete()


class Migration(migrations.Migration):
    dependencies = [("jobs", "0002_dataset_basemodel")]

    operations = [migrations.RunPython(register_tiny, unregister_tiny)]
