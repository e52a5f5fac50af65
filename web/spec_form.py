"""A Django form built from the JobSpec's JSON schema.

The page follows the spec model: a field added to ``jobs.spec`` appears on the form with its
description as help text and its default as the initial value, without touching this module.
Nested sections (``lora``, ``optimizer``, ...) become fieldsets; field names join the path
with ``__`` (``lora__rank``) and errors from ``SpecError`` (``lora.rank``) map back to them.

Only values that differ from the spec's defaults go into the submitted spec: the stored spec
is normalised by ``submit_job`` anyway, and a smoke job refuses training fields that were
changed, so sending defaults back would add noise without changing anything.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from django import forms

from accounts.json_checks import MAX_JSON_DEPTH, json_depth
from jobs import spec as spec_module
from jobs.spec import JobSpec

SEP = "__"
# Fields the page offers through dedicated pickers, or that are not user choices.
SPECIAL = {"version", "method", "base_model", "env", "dataset"}
METHOD_HELP = {  # shown beside the method picker
    "smoke": "Built-in smoke job: a few seconds of real work per step, no model, no env.",
    "rl": "Reinforcement learning against an environment's reward.",
    "sft": "Supervised fine-tuning on a dataset's answers.",
}


@dataclass
class Section:
    """A fieldset of the form: top-level scalars or one nested spec section.

    ``methods`` lists the methods that read the section; the page hides the others (with
    JavaScript; without it every section shows, its legend saying which methods read it).
    """

    key: str
    title: str
    description: str
    methods: tuple[str, ...] = ("smoke", "rl", "sft")
    names: list[str] = field(default_factory=list)


def methods_of(name: str) -> tuple[str, ...]:
    """Which methods read a top-level spec field, from the spec module's own lists."""
    training = getattr(spec_module, "TRAINING_FIELDS", ())
    rl_only = getattr(spec_module, "RL_ONLY_FIELDS", ())
    if name.startswith("smoke_"):
        return ("smoke",)
    if name in rl_only:
        return ("rl",)
    if name == "batch_size":
        return ("sft",)
    if name in training:
        return ("rl", "sft")
    return ("smoke", "rl", "sft")


def spec_defaults() -> dict[str, Any]:
    return JobSpec.model_validate({"method": "smoke"}).model_dump(mode="json")


def _resolve(schema: dict[str, Any], prop: dict[str, Any]) -> dict[str, Any]:
    ref = prop.get("$ref")
    if ref:
        return schema["$defs"][ref.rsplit("/", 1)[-1]]
    return prop


def _variants(prop: dict[str, Any]) -> tuple[list[dict[str, Any]], bool]:
    """The non-null alternatives of a property and whether null is allowed."""
    options = prop.get("anyOf") or [prop]
    nullable = any(o.get("type") == "null" for o in options)
    return [o for o in options if o.get("type") != "null"], nullable


def _bounds(prop: dict[str, Any]) -> dict[str, Any]:
    out = {}
    if "minimum" in prop:
        out["min_value"] = prop["minimum"]
    if "maximum" in prop:
        out["max_value"] = prop["maximum"]
    return out


# Labels that pydantic's generated titles get wrong ("Gpus", "Max Runtime S", "Lr").
LABELS = {
    "gpus": "GPUs",
    "max_runtime_s": "Max runtime (seconds)",
    "lr": "Learning rate",
    "lora": "LoRA",
    "kl_coef": "KL coefficient",
    "top_p": "Top p",
}


def _label(name: str, prop: dict[str, Any]) -> str:
    if name in LABELS:
        return LABELS[name]
    title = prop.get("title") or name.replace("_", " ")
    return title[:1].upper() + title[1:].lower()


def make_field(name: str, prop: dict[str, Any], default: Any) -> forms.Field:
    """One form field for one schema property; the default is the initial value."""
    variants, nullable = _variants(prop)
    help_text = prop.get("description", "")
    label = _label(name, prop)
    common: dict[str, Any] = {"label": label, "help_text": help_text, "required": False}
    kinds = {v.get("type") for v in variants}
    main = variants[0] if variants else {}
    if "enum" in main and len(variants) == 1:
        choices = [(v, v) for v in main["enum"]]
        return forms.ChoiceField(choices=choices, initial=default, **common)
    if kinds == {"boolean"}:
        return forms.BooleanField(initial=default, **common)
    if kinds == {"integer"}:
        if nullable:
            common["help_text"] = f"{help_text} Leave empty for none."
        return forms.IntegerField(initial=default, **_bounds(main), **common)
    if kinds == {"number"}:
        if nullable:
            common["help_text"] = f"{help_text} Leave empty for none."
        return forms.FloatField(initial=default, **_bounds(main), **common)
    if kinds == {"string"} and not nullable:
        return forms.CharField(initial=default, max_length=main.get("maxLength"), **common)
    # Lists, objects and unions (e.g. "all-linear" or a list of names) are typed as JSON, or
    # as a bare string where the schema allows one.
    initial = default if isinstance(default, str) else json.dumps(default)
    common["help_text"] = f"{help_text} JSON, or plain text where a string is allowed."
    return forms.CharField(
        initial=initial, widget=forms.TextInput(attrs={"spellcheck": "false"}), **common
    )


def _json_or_text(raw: str, prop: dict[str, Any]) -> Any:
    variants, _ = _variants(prop)
    text_ok = any(v.get("type") == "string" for v in variants)
    try:
        value = json.loads(raw)
    except RecursionError:
        raise forms.ValidationError("not valid JSON: nested too deeply") from None
    except ValueError:
        # A JSONDecodeError, or Python's guard on an integer of thousands of digits.
        if text_ok:
            return raw
        raise forms.ValidationError('enter JSON, e.g. [0.9, 0.95] or {"key": 1}') from None
    if json_depth(value) > MAX_JSON_DEPTH:
        raise forms.ValidationError(f"not valid JSON: nested deeper than {MAX_JSON_DEPTH} levels")
    return value


class SpecFields:
    """The spec-driven part of the new-job form: field definitions plus their layout."""

    def __init__(self) -> None:
        schema = JobSpec.model_json_schema()
        defaults = spec_defaults()
        self.schema = schema
        self.defaults = defaults
        self.props: dict[str, dict[str, Any]] = {}
        self.fields: dict[str, forms.Field] = {}
        general = Section("general", "Job", "Settings of every job.")
        smoke = Section("smoke", "Smoke job", "Read by method smoke only.", ("smoke",))
        training = Section("training", "Training", "Read by methods rl and sft.", ("rl", "sft"))
        flat = {general.methods: general, smoke.methods: smoke, training.methods: training}
        self.sections = [general, smoke, training]
        for name, prop in schema["properties"].items():
            if name in SPECIAL:
                continue
            resolved = _resolve(schema, prop)
            if resolved.get("type") == "object" and "properties" in resolved:
                section = Section(
                    name,
                    _label(name, prop),
                    prop.get("description") or resolved.get("description", ""),
                    methods_of(name),
                )
                for sub, sub_prop in resolved["properties"].items():
                    key = f"{name}{SEP}{sub}"
                    self.props[key] = sub_prop
                    self.fields[key] = make_field(sub, sub_prop, defaults[name][sub])
                    section.names.append(key)
                self.sections.append(section)
            else:
                self.props[name] = prop
                self.fields[name] = make_field(name, prop, defaults.get(name))
                methods = methods_of(name)
                target = flat.get(methods)
                if target is None:
                    target = flat[methods] = Section(
                        name,
                        _label(name, prop),
                        f"Read by method {' and '.join(methods)}.",
                        methods,
                    )
                    self.sections.append(target)
                target.names.append(name)

    def to_spec(self, cleaned: dict[str, Any], errors: dict[str, str]) -> dict[str, Any]:
        """The submitted values that differ from the defaults, as a nested spec dict."""
        spec: dict[str, Any] = {}
        for key, prop in self.props.items():
            value = cleaned.get(key)
            path = key.split(SEP)
            default: Any = self.defaults
            for part in path:
                default = default.get(part) if isinstance(default, dict) else None
            variants, nullable = _variants(prop)
            field_obj = self.fields[key]
            if isinstance(field_obj, forms.CharField) and not isinstance(
                field_obj, forms.ChoiceField
            ):
                kinds = {v.get("type") for v in variants}
                if kinds != {"string"} or nullable:
                    raw = (value or "").strip()
                    if raw == "":
                        value = None if nullable else default
                    else:
                        try:
                            value = _json_or_text(raw, prop)
                        except forms.ValidationError as exc:
                            errors[key] = exc.messages[0]
                            continue
            if value is None and not nullable:
                value = default
            if isinstance(field_obj, forms.BooleanField):
                value = bool(value)
            if value == default:
                continue
            target = spec
            for part in path[:-1]:
                target = target.setdefault(part, {})
            target[path[-1]] = value
        return spec
