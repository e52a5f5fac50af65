"""The `geometry` environment: geometry3k-shaped rows, their validation, images in the prompt,
grading, and the same episodes inline and on an env worker."""

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Any

import pytest

from environments import images
from environments.datasets import inspect_file, load_rows, resolve
from environments.envs.geometry import user_content
from environments.registry import ContractError, build_group, group_specs, make_config
from environments.renderer import Renderer
from environments.rollouts import PolicyInput, run_group
from tests.training import vl_models
from training import geometry, vision


@pytest.fixture(scope="module")
def vl_renderer() -> Renderer:
    tokenizer = vl_models.vl_tokenizer()
    tokenizer.chat_template = vision.CHATML_VISION_TEMPLATE
    processor = vl_models.processor()
    return Renderer(
        tokenizer, image_tokens=lambda data: vision.encode_image(processor, data).tokens
    )


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def _row(seed: int = 3, **overrides: Any) -> dict[str, Any]:
    p = geometry.problem(seed)
    return {"images": [_b64(p.image)], "problem": p.problem, "answer": p.answer, **overrides}


def test_it_refuses_rows_whose_images_do_not_decode_naming_the_column(tmp_path: Path) -> None:
    png = geometry.problem(1).image
    rows = [
        _row(),
        _row(images=["not base64 !"]),
        _row(images=[_b64(b"GIF89a not a png")]),
        _row(images=[]),
        _row(images=[_b64(png)] * 9),
        _row(images=[images.data_uri(png)]),
        {"images": [_b64(png)], "answer": "3"},
    ]
    path = tmp_path / "geo.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    report = inspect_file(path, "geometry")
    found = {(e.row, e.column): e.reason for e in report.errors}
    assert set(found) == {
        (2, "images"),
        (3, "images"),
        (4, "images"),
        (5, "images"),
        (7, "problem"),
    }
    assert "base64" in found[2, "images"]
    assert "PNG or JPEG" in found[3, "images"]
    assert "at most 8" in found[5, "images"]
    assert report.bad_rows == 5 and report.rows == 7


def test_it_puts_each_image_where_the_problem_marks_it() -> None:
    a, b = geometry.problem(1).image, geometry.problem(2).image
    parts = user_content("<image>Find x.", [a])
    assert [p["type"] for p in parts] == ["image", "text"]
    assert parts[1]["text"] == "Find x."
    parts = user_content("Compare <image> with <image>.", [a, b])
    assert [p["type"] for p in parts] == ["text", "image", "text", "image", "text"]
    assert images.images_in([{"role": "user", "content": parts}]) == [a, b]
    assert [p["type"] for p in user_content("No mark.", [a])] == ["image", "text"]
    with pytest.raises(ValueError, match="marks 2 images"):
        user_content("<image> and <image>", [a])


def test_it_grades_the_final_answer() -> None:
    builder = build_group(
        {"env": "geometry", "config": {}, "row": _row(), "seed": 0, "group_size": 3}
    )
    answer = _row()["answer"]
    rewards = []
    for episode, action in zip(
        builder.make_episodes(), [f"\\boxed{{{answer}}}", "\\boxed{0}", "no idea"], strict=True
    ):
        messages, _ = episode.initial_observation()
        assert images.images_in(messages) == [geometry.problem(3).image]
        rewards.append(episode.step(action))
    assert [r.reward for r in rewards] == [1.0, 0.0, 0.0]
    assert rewards[2].error == "no_answer"


def test_it_ships_disjoint_builtin_splits_drawn_by_the_generator() -> None:
    train = load_rows(resolve("builtin:geometry_train"), "geometry")
    test = load_rows(resolve("builtin:geometry_test"), "geometry")
    assert len(train) == 512 and len(test) == 128
    assert not {r["seed"] for r in train} & {r["seed"] for r in test}
    for row in test[:10]:
        p = geometry.problem(row["seed"])
        assert (row["problem"], row["answer"], row["kind"]) == (p.problem, p.answer, p.kind)


def test_it_names_bad_settings_and_needs_a_dataset() -> None:
    with pytest.raises(ContractError) as err:
        make_config("geometry", {"max_tokenz": 3})
    assert err.value.field == "env_config.max_tokenz"
    with pytest.raises(ContractError) as err:
        group_specs("geometry", rows=None, n_groups=1, group_size=1)
    assert err.value.field == "dataset"
    with pytest.raises(ContractError) as err:
        build_group(
            {"env": "geometry", "config": {}, "row": _row(images=["x"]), "seed": 0, "group_size": 1}
        )
    assert err.value.field == "row.images"


def test_it_renders_each_image_as_the_tokens_the_processor_gives(vl_renderer: Renderer) -> None:
    row = _row(problem="<image>Find x. Then <image>", images=[_b64(geometry.problem(1).image)] * 2)
    episode = build_group({"env": "geometry", "config": {}, "row": row, "seed": 0, "group_size": 1})
    messages, _ = episode.make_episodes()[0].initial_observation()
    tokens = vl_renderer.prompt_tokens(messages)
    pad = vl_renderer.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    per_image = vision.encode_image(vl_models.processor(), geometry.problem(1).image).tokens
    assert tokens.count(pad) == 2 * per_image
    text_only = Renderer(vl_renderer.tokenizer)
    with pytest.raises(ValueError, match="takes no images"):
        text_only.prompt_tokens(messages)


def _answers(rows: list[dict[str, Any]]) -> dict[tuple[str, bytes], str]:
    return {
        (r["problem"].removeprefix("<image>"), base64.b64decode(r["images"][0])): r["answer"]
        for r in rows
    }


def test_it_plays_the_same_on_an_env_worker_as_inline(
    env_worker: str, vl_renderer: Renderer
) -> None:
    from environments.remote import run_group_remote

    rows = load_rows(resolve("builtin:geometry_test"), "geometry")[:6]
    truth = _answers(rows)

    def solver(inp: PolicyInput) -> str:
        parts = inp.messages[-1]["content"]
        key = (images.text_of(inp.messages[-1]), images.images_in(inp.messages)[0])
        assert parts[0]["type"] == "image"
        return f"\\boxed{{{truth[key]}}}"

    for policy, expected in ((solver, 1.0), (lambda inp: "\\boxed{-1}", 0.0)):
        for spec in group_specs("geometry", rows=rows, n_groups=3, group_size=2, seed=1):
            remote = run_group_remote(policy, spec, vl_renderer, timeout=120)
            inline = run_group(policy, build_group(spec), vl_renderer)
            for r, i in zip(remote, inline, strict=True):
                assert r.error is None, r.error
                assert r.total_reward == i.total_reward == expected
                assert r.tokens() == i.tokens() and r.mask() == i.mask()
                assert r.images() == i.images() == [base64.b64decode(spec["row"]["images"][0])]
