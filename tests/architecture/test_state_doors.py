"""Every ORM write happens in a services module (or models, migrations, management commands).

Pages, API views, tasks and runners ask a service to change state; the service is the one
place that knows the rule (the last owner of a team, the conditional UPDATE of a job). The
check walks the syntax tree: a call of a write method on a manager or queryset chain
(`X.objects....update(...)`, `obj.related_set.create(...)`) or `.save()` / `.delete()` on
anything that is not a known non-ORM object (a Redis client, a checkpoint store).
"""

from __future__ import annotations

import ast
from pathlib import Path

from tests.architecture import PACKAGES, ROOT

# The engine holds no database state: training/ is left out.
SERVER_APPS = tuple(p for p in PACKAGES if p != "training")

# The services whose file name does not say so; docs/internals.md lists what each one owns.
SERVICE_MODULES = {
    "accounts/keys.py",  # API keys: issue, rotate, revoke
    "accounts/teams.py",  # teams, memberships, invitations, quotas
    "jobs/datasets.py",  # dataset uploads and deletion under the team's quota lock
    "workers/audit.py",  # the database's record of GPU leases (Redis is the authority)
}
WRITE_METHODS = {
    "save",
    "delete",
    "create",
    "get_or_create",
    "update_or_create",
    "bulk_create",
    "bulk_update",
    "update",
}
# Receivers of .save()/.delete() that are not model instances.
NOT_ORM = {"redis", "client", "get_redis", "pipe", "pipeline", "_r", "checkpoints", "torch"}


def _receiver_names(node: ast.expr) -> list[str]:
    names: list[str] = []
    while True:
        if isinstance(node, ast.Attribute):
            names.append(node.attr)
            node = node.value
        elif isinstance(node, ast.Call):
            node = node.func
        elif isinstance(node, ast.Subscript):
            node = node.value
        elif isinstance(node, ast.Name):
            names.append(node.id)
            return names
        else:
            return names


def _parse(source: str) -> ast.Module:
    # Python 3.11's AST builder keeps its recursion count per interpreter, not per thread; a
    # live server thread of another test formatting a traceback (3.11's traceback parses the
    # failing line) at the same moment fails the parse with "AST constructor recursion depth
    # mismatch". The source is the same on a second try.
    for _ in range(4):
        try:
            return ast.parse(source)
        except SystemError:
            continue
    return ast.parse(source)


def orm_writes(source: str) -> list[tuple[int, str]]:
    """(line, call) of each ORM write in `source`."""
    found = []
    for node in ast.walk(_parse(source)):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
            continue
        method = node.func.attr
        if method not in WRITE_METHODS:
            continue
        names = _receiver_names(node.func.value)
        on_manager = "objects" in names or any(n.endswith("_set") for n in names)
        on_instance = method in {"save", "delete"} and not NOT_ORM.intersection(names)
        if on_manager or on_instance:
            found.append((node.lineno, ".".join(reversed(names)) + "." + method))
    return found


def _allowed(relative: str) -> bool:
    parts = Path(relative).parts
    return (
        relative in SERVICE_MODULES
        or "services" in Path(relative).stem
        or "services" in parts
        or Path(relative).name in {"models.py", "managers.py"}
        or "migrations" in parts
        or ("management" in parts and "commands" in parts)
    )


def test_it_finds_orm_writes_only_in_services() -> None:
    offenders = []
    for package in SERVER_APPS:
        for path in sorted((ROOT / package).rglob("*.py")):
            relative = path.relative_to(ROOT).as_posix()
            if _allowed(relative):
                continue
            for line, call in orm_writes(path.read_text()):
                offenders.append(f"{relative}:{line}: {call}")
    assert not offenders, "ORM writes outside a services module:\n" + "\n".join(offenders)


def test_it_recognises_the_writes_it_looks_for() -> None:
    source = """
Job.objects.filter(pk=1).update(state="x")
job.save(update_fields=["state"])
team.membership_set.create(user=u)
Quota.objects.get_or_create(team=t)
conf.get_redis().delete("k")
torch.save(state, path)
row.update({"a": 1})
"""
    assert [line for line, _ in orm_writes(source)] == [2, 3, 4, 5]
