"""Weights out through the protocol: ``save_weights_external`` and the signed links the
cookbook's ``weights.download`` fetches, then the cookbook's ``build_hf_model`` and peft on
what came out, against a live server with the official SDK."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.tinker_api.conftest import BASE_NAME

tinker = pytest.importorskip(
    "tinker",
    reason="the tinker SDK (a test dependency) is not importable; `pip install tinker==0.38.0`",
    exc_type=ImportError,
)
weights = pytest.importorskip("tinker_cookbook.weights", exc_type=ImportError)
from tinker import types  # noqa: E402

from tests.tinker_api.test_refusals import server  # noqa: E402, F401
from tests.tinker_api.test_sdk_live import EXAMPLES, service_client, sft_datum  # noqa: E402

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(300),
    pytest.mark.usefixtures("clean_tinker_keys"),
]


def hf_logprobs(model: Any, data: list[types.Datum]) -> list[np.ndarray]:
    import torch

    out = []
    with torch.no_grad():
        for datum in data:
            ids = torch.tensor([datum.model_input.to_ints()])
            logits = model(input_ids=ids).logits.float()
            targets = torch.tensor(datum.loss_fn_inputs["target_tokens"].to_numpy())
            lp = torch.log_softmax(logits[0], dim=-1).gather(1, targets[:, None])[:, 0]
            out.append(lp.numpy())
    return out


def trained(service: Any, data: list[types.Datum], **lora: Any) -> Any:
    training = service.create_lora_training_client(
        base_model=BASE_NAME, rank=4, seed=2, **lora
    ).result()
    for _ in range(3):
        training.forward_backward(data, "cross_entropy")
        training.optim_step(types.AdamParams(learning_rate=2e-2)).result()
    return training


def test_it_exports_weights_that_the_cookbook_and_peft_load(
    server: str,  # noqa: F811
    owner_key: tuple[Any, str],
    outsider_key: tuple[Any, str],
    tinker_base: Any,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import httpx
    import torch
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    monkeypatch.setenv("TINKER_API_KEY", "tml-" + owner_key[1])
    base_dir = str(tinker_base.resolved_path())
    with service_client(server, owner_key[1]) as service:
        tokenizer = (
            service.create_lora_training_client(base_model=BASE_NAME, rank=4)
            .result()
            .get_tokenizer()
        )
        data = [sft_datum(tokenizer, p, a) for p, a in EXAMPLES]

        # Attention and MLP adapters: peft and the merged model both reproduce the server.
        body = trained(service, data, train_unembed=False)
        served = [
            o["logprobs"].to_numpy()
            for o in body.forward(data, "cross_entropy").result().loss_fn_outputs
        ]
        external = body.save_weights_external("final").result().path
        assert external == f"tinker://{body.model_id}/external_weights/final"
        adapter = weights.download(
            tinker_path=external, output_dir=str(tmp_path / "a"), base_url=server
        )
        assert {p.name for p in Path(adapter).iterdir()} >= {
            "adapter_model.safetensors",
            "adapter_config.json",
        }
        base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
        peft_model = PeftModel.from_pretrained(base, adapter).eval()
        for got, want in zip(hf_logprobs(peft_model, data), served, strict=True):
            np.testing.assert_allclose(got, want, atol=2e-4)
        weights.build_hf_model(
            base_model=base_dir,
            adapter_path=adapter,
            output_path=str(tmp_path / "merged"),
            dtype="float32",
        )
        merged = AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged"), dtype=torch.float32)
        for got, want in zip(hf_logprobs(merged, data), served, strict=True):
            np.testing.assert_allclose(got, want, atol=2e-4)

        # A training state downloads through a temporary, age-encrypted export.
        state = body.save_state("state").result().path
        from_state = weights.download(
            tinker_path=state, output_dir=str(tmp_path / "s"), base_url=server
        )
        got = load_file(str(Path(from_state) / "adapter_model.safetensors"))
        want = load_file(str(Path(adapter) / "adapter_model.safetensors"))
        assert got.keys() == want.keys()
        for name, tensor in want.items():
            torch.testing.assert_close(got[name], tensor, atol=0, rtol=0)
        rest = tinker.RestClient(base_url=server)
        listed = rest.list_checkpoints(body.model_id).result().checkpoints
        assert sorted(c.checkpoint_id for c in listed) == [
            "external_weights/final",
            "weights/state",
        ]

        # A LoRA on the tied head (the tiny model ties it): the cookbook merges it into the
        # shared embedding as it does Tinker's own adapters; peft loads the rest.
        headed = trained(service, data)
        external = headed.save_weights_external("final").result().path
        adapter = weights.download(
            tinker_path=external, output_dir=str(tmp_path / "h"), base_url=server
        )
        weights.build_hf_model(
            base_model=base_dir,
            adapter_path=adapter,
            output_path=str(tmp_path / "merged-h"),
            dtype="float32",
        )
        assert (tmp_path / "merged-h" / "config.json").is_file()
        base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
        PeftModel.from_pretrained(base, adapter)

        # The links are the only key to the files: signed, per file, for this team only.
        urls = rest.get_external_weights_urls(external).result().urls
        link = urls["adapter_config.json"]
        assert httpx.get(link).status_code == 200
        forged = httpx.get(link.replace("adapter_config.json", "adapter_model.safetensors"))
        assert forged.status_code == 404 and "invalid" in forged.json()["detail"]
        assert httpx.get(link[:-30] + "x" * 10 + link[-20:]).status_code == 404
        outsider = tinker.RestClient(base_url=server, api_key="tml-" + outsider_key[1])
        with pytest.raises(tinker.NotFoundError):
            outsider.get_external_weights_urls(external).result()

        with pytest.raises(tinker.BadRequestError, match="exists"):
            headed.save_weights_external("final").result()
        with pytest.raises(tinker.BadRequestError, match="age X25519"):
            headed.save_weights_external("other", age_encryption_recipients=["nope"]).result()
        # Refused saves spent their seq_ids: the model still runs.
        headed.forward(data, "cross_entropy").result(timeout=60)
