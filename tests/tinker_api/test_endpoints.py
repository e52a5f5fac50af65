"""Every path the SDK 0.38 can call answers JSON: implemented, or a 4xx that says it is not
supported; any other path under ``/api/v1/`` is a JSON 404, even with DEBUG on. Token ids
outside the vocabulary in training data are refused at submission. No worker is needed."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
from django.test import Client

from tests.tinker_api.test_protocol import api, fwdbwd_body, new_model, new_session

pytestmark = pytest.mark.usefixtures("clean_tinker_keys")

SDK_DIR = Path(__file__).resolve().parents[2] / ".venv/lib/python3.11/site-packages/tinker"


def sdk_paths() -> list[str]:
    """Every ``/api/v1/...`` path literal in the installed SDK (tests excluded), with
    each ``{placeholder}`` given a sample value."""
    if not SDK_DIR.is_dir():
        pytest.skip("the tinker SDK is not installed in .venv")
    found: set[str] = set()
    for source in SDK_DIR.rglob("*.py"):
        if source.name.endswith("_test.py") or "tests" in source.parts:
            continue
        found.update(re.findall(r"""f?["'](/api/v1/[^"']*)["']""", source.read_text()))
    samples = {"checkpoint_id": "weights/x"}
    return sorted(
        re.sub(r"\{(\w+)\}", lambda m: samples.get(m.group(1), "x-" + m.group(1)), p) for p in found
    )


# SDK paths answered with a JSON 404 that names the feature this server does not offer.
NOT_SUPPORTED = {
    "/api/v1/copy_weights",
    "/api/v1/create_custom_loss",
    "/api/v1/join_sampling_session",
    "/api/v1/retrieve_futures",
    "/api/v1/auth/token",
    "/api/v1/auth/apikey/me",
    "/api/v1/audit",
    "/api/v1/billing/usage/events",
    "/api/v1/billing/usage/checkpoints/current",
    "/api/v1/sessions/search",
    "/api/v1/sessions/x-session_id/project",
    "/api/v1/sessions/x-session_id/trace_export",
}


def test_it_answers_every_sdk_path_with_json_and_never_a_page(
    tinker_base: Any, owner_key: tuple[Any, str], settings: Any
) -> None:
    # DEBUG shows Django's HTML 404 page instead of the project's JSON handler.
    settings.DEBUG = True
    client = Client(raise_request_exception=False)
    headers = {"HTTP_X_API_KEY": "tml-" + owner_key[1]}
    paths = sdk_paths()
    assert "/api/v1/save_weights_external" in paths and len(paths) > 40
    assert set(paths) >= NOT_SUPPORTED
    for path in paths:
        for method in ("get", "post", "put", "delete"):
            if method == "get":
                res = client.get(path, **headers)
            else:
                send = getattr(client, method)
                res = send(path, b"{}", content_type="application/json", **headers)
            where = f"{method.upper()} {path}"
            assert res.status_code < 500, (where, res.content[:200])
            if res.status_code == 204:
                continue
            assert res["Content-Type"].startswith("application/json"), (where, res.content[:200])
            body = json.loads(res.content)
            if res.status_code >= 400:
                assert body.get("detail"), where
        if path in NOT_SUPPORTED:
            res = client.post(path, b"{}", content_type="application/json", **headers)
            assert res.status_code == 404
            assert "is not supported by this server" in res.json()["detail"], path


@pytest.mark.parametrize(
    "path",
    [
        "/api/v1/no_such_endpoint",
        "/api/v1/create_model/extra",
        "/api/v1/samplers/a/b",
        "/api/v1/asample/",
    ],
)
def test_it_answers_wrong_paths_under_the_prefix_with_a_json_404(
    path: str, settings: Any, db: None
) -> None:
    settings.DEBUG = True
    for method in ("get", "post"):
        res = getattr(Client(), method)(path)
        assert res.status_code == 404
        assert res["Content-Type"].startswith("application/json")
        assert path in res.json()["detail"]


@pytest.mark.parametrize(
    ("where", "tokens", "targets", "message"),
    [
        ("input", [5, 6, 10_000, 8], None, "data[0].model_input: token id 10000 at position 2"),
        (
            "target",
            [5, 6, 7, 8],
            [6, 7, 8, 10_000],
            "data[0].loss_fn_inputs['target_tokens']: token id 10000 at position 3",
        ),
        (
            "negative",
            [5, 6, 7, 8],
            [6, -2, 8, 9],
            "data[0].loss_fn_inputs['target_tokens']: token id -2 at position 1",
        ),
    ],
)
def test_it_refuses_token_ids_outside_the_vocabulary_at_submission(
    tinker_base: Any,
    owner_key: tuple[Any, str],
    where: str,
    tokens: list[int],
    targets: list[int] | None,
    message: str,
) -> None:
    client = Client()
    key = owner_key[1]
    _, model_id = new_model(client, key, new_session(client, key))
    body = fwdbwd_body(model_id, 1)
    datum = body["forward_backward_input"]["data"][0]
    datum["model_input"]["chunks"][0]["tokens"] = tokens
    datum["loss_fn_inputs"]["target_tokens"]["data"] = targets or [*tokens[1:], 5]
    datum["loss_fn_inputs"]["weights"]["data"] = [1.0] * len(tokens)
    for path in ("forward_backward", "forward"):
        res = api(client, key, path, body)
        assert res.status_code == 400, res.content
        assert message in res.json()["detail"]
        assert "outside the vocabulary" in res.json()["detail"]
