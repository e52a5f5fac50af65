"""Forms of the web pages. Validation that the services own (spec, quotas, datasets) stays
there: the views turn their exceptions into errors beside the fields."""

from __future__ import annotations

from typing import Any

import yaml
from django import forms

from accounts.json_checks import MAX_JSON_DEPTH, json_depth
from accounts.models import Invitation, Membership, Team
from accounts.validators import validate_display_name
from environments.datasets import builtin_names
from environments.registry import env_names, get_env
from jobs.models import BaseModel, Dataset, JobState
from jobs.sampling import MAX_SAMPLE_IMAGE_BYTES

from .spec_form import METHOD_HELP, SpecFields

UPLOAD = "__upload__"
# A spec is a few hundred bytes; the same bound for one typed in and one uploaded.
MAX_SPEC_BYTES = 1_000_000


class SpecYamlLoader(yaml.SafeLoader):
    """YAML without aliases. A spec never needs one, and an alias is what builds a cyclic
    structure (``a: &a [*a]``, which every later walk of the spec follows forever) or a
    "billion laughs" expansion of a few lines into billions of nodes."""

    def compose_node(self, parent: Any, index: Any) -> Any:
        if self.check_event(yaml.AliasEvent):
            event = self.peek_event()
            raise yaml.composer.ComposerError(
                None, None, "YAML aliases (*name) are not accepted in a spec", event.start_mark
            )
        return super().compose_node(parent, index)


def env_choices() -> list[tuple[str, str]]:
    out = [("", "— none (smoke jobs) —")]
    for name in env_names():
        env = get_env(name)
        source, interaction = env.cell
        out.append((name, f"{name} ({source}, {interaction.replace('_', ' ')})"))
    return out


def dataset_choices(team: Team | None) -> list[tuple[str, Any]]:
    team_sets: list[tuple[str, str]] = []
    if team is not None:
        for ds in Dataset.objects.filter(team=team).order_by("name"):
            team_sets.append((ds.ref, f"{ds.name} (env {ds.env}, {ds.rows} rows)"))
    builtin = [(f"builtin:{n}", f"builtin:{n}") for n in builtin_names()]
    return [
        ("", "— none —"),
        ("Team datasets", team_sets),
        ("Built-in", builtin),
        (UPLOAD, "Upload a file below…"),
    ]


class JobForm(forms.Form):
    """Name, method and pickers, followed by the JobSpec's own fields."""

    name = forms.CharField(
        max_length=200,
        required=False,
        help_text="Shown in the jobs list.",
        validators=[validate_display_name],
    )
    method = forms.ChoiceField(
        choices=[(m, m) for m in METHOD_HELP],
        initial="smoke",
        help_text=" ".join(f"{m}: {h}" for m, h in METHOD_HELP.items()),
    )
    base_model = forms.ChoiceField(help_text="Registered base models (managed by administrators).")
    env = forms.ChoiceField(
        required=False, label="Environment", help_text="Required for rl and sft jobs."
    )
    dataset = forms.ChoiceField(
        required=False,
        help_text="Needed when the environment reads a dataset (e.g. math).",
    )
    dataset_file = forms.FileField(
        required=False,
        label="Upload a dataset",
        help_text="JSON Lines or Parquet, validated against the environment's columns.",
    )
    dataset_name = forms.CharField(
        required=False,
        max_length=200,
        help_text="Name of the uploaded dataset in your team.",
        validators=[validate_display_name],
    )

    def __init__(self, *args: Any, team: Team | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.spec_fields = SpecFields()
        models = list(BaseModel.objects.enabled().values_list("name", flat=True))
        self.fields["base_model"].choices = [(m, m) for m in models]
        default_model = self.spec_fields.defaults.get("base_model")
        if default_model in models:
            self.fields["base_model"].initial = default_model
        self.fields["env"].choices = env_choices()
        self.fields["dataset"].choices = dataset_choices(team)
        self.fields.update(self.spec_fields.fields)

    def sections(self) -> list[dict[str, Any]]:
        return [
            {
                "title": s.title,
                "description": s.description,
                "key": s.key,
                "methods": " ".join(s.methods),
                "fields": [self[n] for n in s.names],
            }
            for s in self.spec_fields.sections
            if s.names
        ]

    def clean(self) -> dict[str, Any]:
        data = super().clean()
        if data.get("dataset") == UPLOAD:
            if not data.get("dataset_file"):
                self.add_error("dataset_file", "choose a file to upload")
            if not (data.get("dataset_name") or "").strip():
                self.add_error("dataset_name", "name the uploaded dataset")
            if not data.get("env"):
                self.add_error("env", "a dataset is validated for an environment: pick one")
        return data


class JobFilterForm(forms.Form):
    """The jobs list's query parameters. Bounded because the search becomes a LIKE pattern
    per column: SQLite refuses one over 50,000 bytes and PostgreSQL any NUL character, both
    as server errors rather than as a filter that matches nothing."""

    ACTIVE = "active"

    q = forms.CharField(required=False, max_length=200, label="Search")
    state = forms.ChoiceField(
        required=False,
        label="State",
        choices=[("", "Any"), (ACTIVE, "Not finished"), *JobState.choices],
    )


class YamlJobForm(forms.Form):
    name = forms.CharField(max_length=200, required=False, validators=[validate_display_name])
    spec_yaml = forms.CharField(
        max_length=MAX_SPEC_BYTES,
        label="Job spec (YAML or JSON)",
        widget=forms.Textarea(attrs={"rows": 14, "spellcheck": "false"}),
        help_text="The same JobSpec the API and the CLI accept, e.g. `method: smoke`.",
    )
    spec_file = forms.FileField(required=False, label="…or a spec file")

    def _file_text(self, upload: Any) -> str | None:
        """The spec file as text, or None with the reason beside the field. A file cut at
        the limit could still parse, as a different spec (its tail of settings lost)."""
        raw: bytes = upload.read(MAX_SPEC_BYTES + 1)
        if len(raw) > MAX_SPEC_BYTES:
            self.add_error("spec_file", f"the spec file is larger than {MAX_SPEC_BYTES} bytes")
            return None
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            self.add_error("spec_file", f"the spec file is not UTF-8 text (byte {exc.start})")
            return None

    def clean(self) -> dict[str, Any]:
        data = super().clean()
        raw = data.get("spec_yaml") or ""
        if data.get("spec_file"):
            if raw.strip():
                # Either could be the one meant: the job is not submitted on a guess.
                self.add_error("spec_file", "give the spec as typed text or as a file, not both")
                return data
            text = self._file_text(data["spec_file"])
            if text is None:
                return data
            raw = text
        try:
            spec = yaml.load(raw, Loader=SpecYamlLoader)
        except yaml.YAMLError as exc:
            self.add_error("spec_yaml", f"not valid YAML: {exc}")
            return data
        except RecursionError:
            self.add_error("spec_yaml", f"the spec is nested deeper than {MAX_JSON_DEPTH} levels")
            return data
        except ValueError as exc:
            # Python's own guards, not YAML errors: an integer of thousands of digits, a date
            # such as 2024-13-45.
            self.add_error("spec_yaml", f"not valid YAML: a value cannot be read: {exc}")
            return data
        if not isinstance(spec, dict):
            self.add_error("spec_yaml", "the spec must be a mapping such as `method: smoke`")
            return data
        if json_depth(spec) > MAX_JSON_DEPTH:
            self.add_error("spec_yaml", f"the spec is nested deeper than {MAX_JSON_DEPTH} levels")
            return data
        data["spec"] = spec
        return data

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.fields["spec_yaml"].required = False


class KeyForm(forms.Form):
    name = forms.CharField(
        max_length=100, help_text="e.g. laptop, ci, notebook", validators=[validate_display_name]
    )
    expires_in_days = forms.IntegerField(
        required=False, min_value=1, max_value=3650, help_text="Leave empty for no expiry."
    )


class InviteForm(forms.Form):
    # The column's length (RFC 5321's path limit): the form's own default lets 320 through,
    # which PostgreSQL refuses as a server error.
    email = forms.EmailField(max_length=Invitation._meta.get_field("email").max_length)
    role = forms.ChoiceField(choices=Membership.Role.choices, initial=Membership.Role.MEMBER)


class RoleForm(forms.Form):
    role = forms.ChoiceField(choices=Membership.Role.choices)


class DatasetForm(forms.Form):
    name = forms.CharField(max_length=200, validators=[validate_display_name])
    env = forms.ChoiceField(label="Environment")
    file = forms.FileField(
        help_text="JSON Lines (.jsonl), Parquet (.parquet), or a .zip of a .jsonl and its images."
    )

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.fields["env"].choices = [c for c in env_choices() if c[0]]


class SampleForm(forms.Form):
    """The sample box of a finished job; bounds mirror the API's ``SampleRequestSerializer``
    because the generation runs inside the web process."""

    CHAT = "chat"
    RAW = "raw"

    prompt = forms.CharField(
        max_length=20_000,
        strip=False,
        widget=forms.Textarea(attrs={"rows": 3}),
        help_text="e.g. What is 12+34?",
    )
    mode = forms.ChoiceField(
        choices=[
            (CHAT, "Chat: one user message, base model's chat template"),
            (RAW, "Raw text to continue"),
        ],
        initial=CHAT,
        label="Prompt as",
        help_text="Chat replies stop at the end of the assistant's turn.",
    )
    max_tokens = forms.IntegerField(min_value=1, max_value=256, initial=64, label="Max tokens")
    temperature = forms.FloatField(
        min_value=0.0, max_value=2.0, initial=1.0, help_text="0 decodes greedily."
    )
    n = forms.IntegerField(min_value=1, max_value=8, initial=1, label="Samples")
    seed = forms.IntegerField(
        required=False,
        min_value=0,
        max_value=2**31 - 1,
        help_text="Optional: the same seed gives the same samples.",
    )
    image = forms.FileField(
        required=False,
        label="Picture",
        help_text="Optional, PNG or JPEG: shown after your message (chat only).",
        widget=forms.ClearableFileInput(attrs={"accept": "image/png,image/jpeg"}),
    )

    def clean_prompt(self) -> str:
        prompt: str = self.cleaned_data["prompt"]
        if not prompt.strip():
            raise forms.ValidationError("Enter some text to continue.")
        return prompt

    def clean_image(self) -> bytes | None:
        upload = self.cleaned_data.get("image")
        if not upload:
            return None
        if upload.size > MAX_SAMPLE_IMAGE_BYTES:
            raise forms.ValidationError(f"The picture is over {MAX_SAMPLE_IMAGE_BYTES} bytes.")
        data: bytes = upload.read()
        if not data.startswith((b"\x89PNG\r\n\x1a\n", b"\xff\xd8\xff")):
            raise forms.ValidationError("The picture must be a PNG or JPEG file.")
        return data

    def __init__(self, *args: Any, images: bool = True, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # Whether the page offers the picture field (a vision-language base model): errors
        # about a picture sent anyway go above the form, where they are seen.
        self.images = images

    def clean(self) -> dict[str, Any]:
        cleaned = super().clean() or {}
        if not cleaned.get("image"):
            return cleaned
        if not self.images:
            self.add_error(None, "This job's base model takes no pictures.")
        elif cleaned.get("mode") == self.RAW:
            self.add_error("image", "A picture goes with a chat prompt, not raw text.")
        return cleaned
