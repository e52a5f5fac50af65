"""Job specs on the client side: YAML files, Hydra-style ``a.b.c=value`` overrides and the
type check of each override against the JobSpec JSON schema.

The schema is the server's (``components.schemas.JobSpec`` of its OpenAPI document) when it
publishes one, else the copy shipped in this package, exported from ``jobs.spec.JobSpec`` by
``scripts/export_jobspec_schema.py``. Only the overrides are checked here; the server
validates the whole spec (cross-field rules, base model limits) and names each bad field.
"""

from __future__ import annotations

import copy
import difflib
import json
import math
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from .errors import SpecError

Schema = dict[str, Any]


def shipped_schema() -> Schema:
    text = resources.files("opentinker").joinpath("jobspec.schema.json").read_text("utf-8")
    schema: Schema = json.loads(text)
    return schema


def schema_from_openapi(document: dict[str, Any]) -> Schema | None:
    """The JobSpec schema inside an OpenAPI document, with its ``$defs`` in reach."""
    # A document of another shape (not this service's) means the shipped schema, not a crash.
    components = document.get("components")
    schemas = components.get("schemas") if isinstance(components, dict) else None
    if not isinstance(schemas, dict):
        return None
    spec = schemas.get("JobSpec")
    if not isinstance(spec, dict) or not isinstance(spec.get("$defs", {}), dict):
        return None
    spec = copy.deepcopy(spec)
    spec.setdefault("$defs", {}).update(
        {k: v for k, v in schemas.items() if k != "JobSpec" and isinstance(v, dict)}
    )
    return spec


class _JsonLoader(yaml.SafeLoader):
    """YAML read as the JSON it is sent as: a date stays the text it was written as (JSON has
    no dates, and ``dataset: 2024-05-01`` names a dataset)."""


_JsonLoader.yaml_implicit_resolvers = {
    first: [(tag, regexp) for tag, regexp in resolvers if tag != "tag:yaml.org,2002:timestamp"]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}


def _load(text: str) -> Any:
    return yaml.load(text, Loader=_JsonLoader)


def json_problem(value: Any, where: str = "") -> tuple[str, str] | None:
    """The field of ``value`` that JSON cannot carry (a number as a key, ``.nan``, a
    ``!!binary`` value) and why; None when it is all JSON."""
    if isinstance(value, dict):
        for key, item in value.items():
            here = f"{where}.{key}" if where else str(key)
            if not isinstance(key, str):
                return here, "a key must be text (quote it)"
            found = json_problem(item, here)
            if found:
                return found
    elif isinstance(value, list):
        for i, item in enumerate(value):
            found = json_problem(item, f"{where}[{i}]")
            if found:
                return found
    elif isinstance(value, float) and not math.isfinite(value):
        return where, f"{value} is not a number JSON can carry"
    elif value is not None and not isinstance(value, (str, int, float)):
        return where, f"a YAML {type(value).__name__} value is not JSON data"
    return None


def load_yaml(path: str | Path) -> dict[str, Any]:
    try:
        data = _load(Path(path).read_text(encoding="utf-8"))
    except OSError as exc:
        raise SpecError(f"cannot read {path}: {exc.strerror or exc}") from exc
    except UnicodeDecodeError as exc:
        raise SpecError(
            f"{path} is not UTF-8 text (byte {exc.object[exc.start]:#04x} at offset {exc.start})"
        ) from None
    except yaml.YAMLError as exc:
        raise SpecError(f"{path} is not valid YAML: {exc}") from exc
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise SpecError(f"{path}: a job spec is a mapping of fields, got {type(data).__name__}")
    return data


# --- a small JSON-schema checker: the subset pydantic emits for JobSpec ----------------------


def _resolve(schema: Schema, root: Schema) -> Schema:
    while "$ref" in schema:
        ref = schema["$ref"]
        name = ref.rsplit("/", 1)[-1]
        defs = root.get("$defs") or root.get("definitions") or {}
        if name not in defs:
            raise SpecError(f"the JobSpec schema has no definition {ref!r}")
        extra = {k: v for k, v in schema.items() if k != "$ref"}
        schema = {**defs[name], **extra}
    return schema


def _alternatives(schema: Schema, root: Schema) -> list[Schema]:
    schema = _resolve(schema, root)
    for key in ("anyOf", "oneOf"):
        if key in schema:
            out: list[Schema] = []
            for sub in schema[key]:
                out += _alternatives(sub, root)
            return out
    if "allOf" in schema and len(schema["allOf"]) == 1:
        return _alternatives(schema["allOf"][0], root)
    return [schema]


def _type_ok(value: Any, kind: str) -> bool:
    if kind == "null":
        return value is None
    if kind == "boolean":
        return isinstance(value, bool)
    if kind == "integer":
        return isinstance(value, int) and not isinstance(value, bool)
    if kind == "number":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if kind == "string":
        return isinstance(value, str)
    if kind == "array":
        return isinstance(value, list)
    if kind == "object":
        return isinstance(value, dict)
    return True


def _describe(schema: Schema) -> str:
    if "const" in schema:
        return json.dumps(schema["const"])
    if "enum" in schema:
        return "one of " + ", ".join(json.dumps(v) for v in schema["enum"])
    kind = schema.get("type", "any value")
    if kind == "array" and isinstance(schema.get("items"), dict):
        inner = schema["items"].get("type")
        return f"a list of {inner}s" if inner else "a list"
    names = {
        "integer": "an integer",
        "number": "a number",
        "boolean": "true or false",
        "string": "a string",
        "object": "a mapping",
        "null": "null",
    }
    return names.get(str(kind), str(kind))


def check_value(value: Any, schema: Schema, root: Schema) -> str | None:
    """None if ``value`` fits ``schema``, else why not."""
    options = _alternatives(schema, root)
    reasons: list[str] = []
    for option in options:
        reason = _check_one(value, option, root)
        if reason is None:
            return None
        reasons.append(reason)
    if len(options) == 1:
        return reasons[0]
    return "expected " + " or ".join(_describe(o) for o in options)


def _check_one(value: Any, schema: Schema, root: Schema) -> str | None:
    if "const" in schema and value != schema["const"]:
        return f"expected {json.dumps(schema['const'])}"
    if "enum" in schema and value not in schema["enum"]:
        return f"expected {_describe(schema)}"
    kinds = schema.get("type")
    if kinds is not None:
        kinds = kinds if isinstance(kinds, list) else [kinds]
        if not any(_type_ok(value, k) for k in kinds):
            return f"expected {_describe(schema)}, got {json.dumps(value, default=str)}"
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        for key, ok, word in (
            ("minimum", lambda v, b: v >= b, ">="),
            ("maximum", lambda v, b: v <= b, "<="),
            ("exclusiveMinimum", lambda v, b: v > b, ">"),
            ("exclusiveMaximum", lambda v, b: v < b, "<"),
        ):
            if key in schema and not ok(value, schema[key]):
                return f"must be {word} {schema[key]:g}, got {value:g}"
    if isinstance(value, str):
        if "minLength" in schema and len(value) < schema["minLength"]:
            return f"must be at least {schema['minLength']} characters"
        if "maxLength" in schema and len(value) > schema["maxLength"]:
            return f"must be at most {schema['maxLength']} characters"
    if isinstance(value, list) and isinstance(schema.get("items"), dict):
        for i, item in enumerate(value):
            reason = check_value(item, schema["items"], root)
            if reason:
                return f"item {i}: {reason}"
    if isinstance(value, dict) and "properties" in schema:
        for key, item in value.items():
            sub = _child(schema, key, root)
            if sub is None:
                return f"unknown key {key!r}" + _suggest(key, schema)
            reason = check_value(item, sub, root)
            if reason:
                return f"{key}: {reason}"
    return None


def _object_options(schema: Schema, root: Schema) -> list[Schema]:
    return [
        o for o in _alternatives(schema, root) if o.get("type") == "object" or "properties" in o
    ]


def _child(schema: Schema, key: str, root: Schema) -> Schema | None:
    """The schema of ``key`` inside an object schema; None if the key is not allowed."""
    props = schema.get("properties") or {}
    if key in props:
        return dict(props[key])
    extra = schema.get("additionalProperties", True)
    if extra is False:
        return None
    return extra if isinstance(extra, dict) else {}


def _suggest(key: str, schema: Schema) -> str:
    names = list((schema.get("properties") or {}).keys())
    close = difflib.get_close_matches(key, names, n=1, cutoff=0.6)
    if close:
        return f"; did you mean {close[0]!r}?"
    return f"; known keys: {', '.join(sorted(names))}" if names else ""


def _paths(schema: Schema, root: Schema, prefix: str = "", depth: int = 0) -> list[str]:
    """Every dotted key the schema names (nested sections included)."""
    out: list[str] = []
    if depth > 4:
        return out
    for option in _object_options(schema, root):
        for name, sub in (option.get("properties") or {}).items():
            path = f"{prefix}{name}"
            out.append(path)
            out += _paths(sub, root, path + ".", depth + 1)
    return out


def _suggest_path(parts: list[str], root: Schema) -> str:
    """A close match for a mistyped key: same path with a typo, or the leaf in another section
    (``lr`` -> ``optimizer.lr``); else the keys allowed where the typo is."""
    key = ".".join(parts)
    paths = _paths(root, root)
    same_depth = [p for p in paths if p.count(".") == key.count(".")]
    close = difflib.get_close_matches(key, same_depth, n=1, cutoff=0.75)
    if not close:
        leaf = parts[-1]
        leaves = sorted({p.rsplit(".", 1)[-1] for p in paths})
        near = difflib.get_close_matches(leaf, leaves, n=1, cutoff=0.75)
        close = [p for p in paths if near and p.rsplit(".", 1)[-1] == near[0]]
    if close:
        return f"; did you mean {close[0]!r}?"
    section = ".".join(parts[:-1])
    depth = len(parts) - 1
    names = sorted(
        p.rsplit(".", 1)[-1]
        for p in paths
        if p.count(".") == depth and (not section or p.startswith(section + "."))
    )
    where = f"under {section}" if section else "of a JobSpec"
    return f"; known keys {where}: {', '.join(names)}" if names else ""


def parse_override(text: str) -> tuple[list[str], str]:
    key, sep, raw = text.partition("=")
    key = key.strip()
    if not sep or not key:
        raise SpecError(f"override {text!r} is not key=value (e.g. rollout.group_size=8)")
    parts = key.split(".")
    if any(not p for p in parts):
        raise SpecError(f"override {text!r}: empty part in key {key!r}")
    return parts, raw


def _typed(raw: str, schema: Schema, root: Schema, key: str) -> Any:
    """The YAML reading of ``raw`` if it fits, else the raw text where a string fits."""
    value = _yaml(raw)
    reason = check_value(value, schema, root)
    if reason is None:
        return value
    # PyYAML reads `3e-4` as text (YAML 1.1 wants `3.0e-4`); a number field means the number.
    if isinstance(value, str):
        try:
            number = float(raw)
        except ValueError:
            pass
        else:
            if check_value(number, schema, root) is None:
                return number
    # `base_model=123` or `dataset=2024` mean the text, as Hydra would read them for a str field.
    if not isinstance(value, str) and check_value(raw, schema, root) is None:
        return raw
    raise SpecError(f"bad value for {key}: {reason}", errors=[{"field": key, "reason": reason}])


def apply_overrides(
    spec: dict[str, Any], overrides: list[str], schema: Schema | None = None
) -> dict[str, Any]:
    """A copy of ``spec`` with each ``a.b.c=value`` set, type-checked against ``schema``."""
    root = schema if schema is not None else shipped_schema()
    out = copy.deepcopy(spec)
    for text in overrides:
        parts, raw = parse_override(text)
        key = ".".join(parts)
        node: Schema | None = root
        target = out
        for depth, part in enumerate(parts):
            here = ".".join(parts[: depth + 1])
            options = _object_options(node, root) if node is not None else []
            if node is not None and not options and node:
                parent = ".".join(parts[:depth]) or "the spec"
                raise SpecError(
                    f"unknown key {here!r}: {parent} is {_describe(_resolve(node, root))}, "
                    "not a mapping",
                    errors=[{"field": here, "reason": "not a mapping"}],
                )
            child: Schema | None = None
            for option in options:
                child = _child(option, part, root)
                if child is not None:
                    break
            if options and child is None:
                hint = _suggest_path(parts, root)
                raise SpecError(
                    f"unknown key {here!r}{hint}",
                    errors=[{"field": here, "reason": "unknown key" + hint}],
                )
            node = child if options else None
            if depth == len(parts) - 1:
                value = _typed(raw, node, root, key) if node is not None else _yaml(raw)
                problem = json_problem(value, key)
                if problem:
                    raise SpecError(
                        f"bad value for {problem[0]}: {problem[1]}",
                        errors=[{"field": problem[0], "reason": problem[1]}],
                    )
                target[part] = value
            else:
                existing = target.get(part)
                if existing is None:
                    target[part] = existing = {}
                if not isinstance(existing, dict):
                    raise SpecError(f"cannot set {key}: {here} is {existing!r}, not a mapping")
                target = existing
    return out


def _yaml(raw: str) -> Any:
    try:
        return _load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        return raw


def check_spec(spec: dict[str, Any], schema: Schema | None = None) -> list[dict[str, str]]:
    """Unknown keys and wrong types in a whole spec file (the server checks the rest)."""
    root = schema if schema is not None else shipped_schema()
    errors = []
    for key, value in spec.items():
        problem = json_problem({key: value})
        if problem:
            errors.append({"field": problem[0], "reason": problem[1]})
            continue
        sub = _child(root, key, root)
        if sub is None:
            errors.append({"field": key, "reason": "unknown key" + _suggest_path([key], root)})
            continue
        reason = check_value(value, sub, root)
        if reason:
            errors.append({"field": key, "reason": reason})
    return errors
