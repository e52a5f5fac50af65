"""Images through the Tinker protocol: the official SDK's ``ImageChunk`` and
``ImageAssetPointerChunk`` for training, sampling and ``compute_logprobs`` against a live
server whose base model is a (tiny, random) Qwen2.5-VL model."""

from __future__ import annotations

import base64
import math
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

tinker = pytest.importorskip(
    "tinker",
    reason="the tinker SDK (a test dependency) is not importable; `pip install tinker==0.38.0`",
    exc_type=ImportError,
)
from tinker import types

from tests.tinker_api.conftest import sdk_worker_env
from tests.training import vl_models
from training import vision

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

VL_NAME = "tiny-vl-tinker"


@pytest.fixture(scope="session")
def vl_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return vl_models.save_vl_model(tmp_path_factory.mktemp("tiny-vl"))


@pytest.fixture
def server(
    live_server: Any,
    transactional_db: None,
    vl_model_dir: Path,
    start_worker: Callable[..., Any],
    monkeypatch: pytest.MonkeyPatch,
    tinker_data_dir: Path,
    tmp_path: Path,
    settings: Any,
) -> Iterator[tuple[str, Path]]:
    """The live server's URL and a directory it reads image asset pointers from."""
    from jobs.models import BaseModel

    BaseModel.objects.update_or_create(
        name=VL_NAME, defaults={"path": str(vl_model_dir), "max_lora_rank": 16, "max_context": 512}
    )
    assets = tmp_path / "assets"
    assets.mkdir()
    settings.OPENTINKER_IMAGE_ASSET_ROOTS = [assets.resolve()]
    monkeypatch.setenv("OPENTINKER_IMAGE_ASSET_ROOTS", str(assets))
    sdk_worker_env(monkeypatch)
    start_worker()
    return live_server.url + "/", assets


def _tokens(text: str, tokenizer: Any) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=False))


def image_prompt(tokenizer: Any, picture: bytes, question: str, *, expected: int | None) -> Any:
    start, end, _pad = vl_models.image_ids(tokenizer)
    return types.ModelInput(
        chunks=[
            types.EncodedTextChunk(tokens=[*_tokens("Q: ", tokenizer), start]),
            types.ImageChunk(data=picture, format="png", expected_tokens=expected),
            types.EncodedTextChunk(tokens=[end, *_tokens(question + " A:", tokenizer)]),
        ]
    )


def sft_datum(tokenizer: Any, picture: bytes, answer: str) -> types.Datum:
    count = vision.encode_image(vl_models.processor(), picture).tokens
    prompt = image_prompt(tokenizer, picture, "colour?", expected=count)
    answer_ids = [*_tokens(" " + answer, tokenizer), tokenizer.eos_token_id]
    chunks = [*prompt.chunks, types.EncodedTextChunk(tokens=answer_ids)]
    model_input = types.ModelInput(chunks=chunks)
    full = model_input.length
    # Targets: the next position's token (any id where the next position is an image: the
    # server keeps image positions out of the loss).
    flat: list[int] = []
    for chunk in chunks:
        flat += list(chunk.tokens) if isinstance(chunk, types.EncodedTextChunk) else [0] * count
    weights = [0.0] * (full - len(answer_ids) - 1) + [1.0] * len(answer_ids)
    return types.Datum(
        model_input=types.ModelInput(chunks=_drop_last(chunks)),
        loss_fn_inputs={
            "target_tokens": np.array(flat[1:], dtype=np.int64),
            "weights": np.array(weights[: full - 1], dtype=np.float32),
        },
    )


def _drop_last(chunks: list[Any]) -> list[Any]:
    last = chunks[-1]
    return [*chunks[:-1], types.EncodedTextChunk(tokens=list(last.tokens)[:-1])]


def test_it_trains_samples_and_scores_with_image_chunks(
    server: tuple[str, Path], owner_key: tuple[Any, str]
) -> None:
    url, _assets = server
    red, blue = vl_models.picture(1), vl_models.picture(2)
    with tinker.ServiceClient(base_url=url, api_key="tml-" + owner_key[1]) as service:
        training = service.create_lora_training_client(base_model=VL_NAME, rank=8, seed=1).result()
        tokenizer = training.get_tokenizer()
        data = [sft_datum(tokenizer, red, "red"), sft_datum(tokenizer, blue, "blue")]
        losses = []
        for _ in range(8):
            fwd = training.forward_backward(data, "cross_entropy")
            training.optim_step(types.AdamParams(learning_rate=1e-2)).result()
            result = fwd.result()
            assert math.isfinite(result.metrics["loss:sum"])
            lp = [out["logprobs"].to_numpy() for out in result.loss_fn_outputs]
            w = [d.loss_fn_inputs["weights"].to_numpy() for d in data]
            losses.append(
                sum(float(-(a * b).sum()) for a, b in zip(lp, w)) / sum(x.sum() for x in w)
            )
        assert losses[-1] < 0.6 * losses[0], losses

        sampler = training.save_weights_and_get_sampling_client().result()
        count = vision.encode_image(vl_models.processor(), red).tokens
        assert count == vision.encode_image(vl_models.processor(), blue).tokens
        params = types.SamplingParams(max_tokens=8, temperature=0.0)
        for name, picture in (("red", red), ("blue", blue)):
            prompt = image_prompt(tokenizer, picture, "colour?", expected=count)
            out = sampler.sample(prompt, num_samples=1, sampling_params=params).result()
            # Each picture gets the answer it was trained with: the image decides.
            assert out.sequences[0].tokens == [
                *_tokens(" " + name, tokenizer),
                tokenizer.eos_token_id,
            ]

        # compute_logprobs over an image prompt: the image changes the distribution.
        prompt = image_prompt(tokenizer, red, "colour?", expected=count)
        scored_red = sampler.compute_logprobs(prompt).result()
        scored_blue = sampler.compute_logprobs(
            image_prompt(tokenizer, blue, "colour?", expected=count)
        ).result()
        assert len(scored_red) == prompt.length and scored_red[0] is None
        assert scored_red[-1] != pytest.approx(scored_blue[-1], abs=1e-6)


def test_it_refuses_a_wrong_expected_tokens_naming_the_chunk(
    server: tuple[str, Path], owner_key: tuple[Any, str]
) -> None:
    url, _assets = server
    picture = vl_models.picture(1)
    with tinker.ServiceClient(base_url=url, api_key="tml-" + owner_key[1]) as service:
        training = service.create_lora_training_client(base_model=VL_NAME, rank=4, seed=1).result()
        tokenizer = training.get_tokenizer()
        count = vision.encode_image(vl_models.processor(), picture).tokens
        sampler = service.create_sampling_client(base_model=VL_NAME).result()
        wrong = image_prompt(tokenizer, picture, "x", expected=count + 3)
        with pytest.raises(Exception, match=r"chunks\[1\]: expected_tokens is"):
            sampler.sample(
                wrong, num_samples=1, sampling_params=types.SamplingParams(max_tokens=1)
            ).result()
        datum = sft_datum(tokenizer, picture, "red")
        bad = datum.model_input.chunks[1].model_copy(update={"expected_tokens": count + 1})
        chunks = [datum.model_input.chunks[0], bad, *datum.model_input.chunks[2:]]
        broken = types.Datum(
            model_input=types.ModelInput(chunks=chunks),
            loss_fn_inputs={
                "target_tokens": np.zeros(datum.model_input.length + 1, dtype=np.int64),
                "weights": np.zeros(datum.model_input.length + 1, dtype=np.float32),
            },
        )
        with pytest.raises(Exception, match=r"data\[0\]\.model_input\.chunks\[1\]"):
            training.forward_backward([broken], "cross_entropy").result()


def test_it_reads_asset_pointers_from_data_uris_and_its_asset_roots_only(
    server: tuple[str, Path], owner_key: tuple[Any, str], vl_model_dir: Path
) -> None:
    from transformers import AutoTokenizer

    url, assets = server
    picture = vl_models.picture(4)
    (assets / "p.png").write_bytes(picture)
    count = vision.encode_image(vl_models.processor(), picture).tokens
    with tinker.ServiceClient(base_url=url, api_key="tml-" + owner_key[1]) as service:
        sampler = service.create_sampling_client(base_model=VL_NAME).result()
        tokenizer = AutoTokenizer.from_pretrained(str(vl_model_dir))
        start, end, _ = vl_models.image_ids(tokenizer)
        params = types.SamplingParams(max_tokens=4, temperature=0.0)

        def prompt(location: str) -> Any:
            return types.ModelInput(
                chunks=[
                    types.EncodedTextChunk(tokens=[*_tokens("Q: ", tokenizer), start]),
                    types.ImageAssetPointerChunk(
                        format="png", location=location, expected_tokens=count
                    ),
                    types.EncodedTextChunk(tokens=[end, *_tokens("A:", tokenizer)]),
                ]
            )

        data_uri = "data:image/png;base64," + base64.b64encode(picture).decode()
        inline = types.ModelInput(
            chunks=[
                types.EncodedTextChunk(tokens=[*_tokens("Q: ", tokenizer), start]),
                types.ImageChunk(data=picture, format="png", expected_tokens=count),
                types.EncodedTextChunk(tokens=[end, *_tokens("A:", tokenizer)]),
            ]
        )
        expected = sampler.sample(inline, num_samples=1, sampling_params=params).result()
        for location in (data_uri, str(assets / "p.png"), f"file://{assets / 'p.png'}"):
            got = sampler.sample(prompt(location), num_samples=1, sampling_params=params).result()
            assert got.sequences[0].tokens == expected.sequences[0].tokens, location
        for location, reason in (
            ("/etc/hostname", "OPENTINKER_IMAGE_ASSET_ROOTS"),
            ("https://example.com/a.png", "fetches no URLs"),
            (str(assets / "missing.png"), "cannot read"),
        ):
            with pytest.raises(Exception, match=reason):
                sampler.sample(prompt(location), num_samples=1, sampling_params=params).result()
