"""Multi-LoRA batching against peft: every row must equal its adapter run alone."""

from __future__ import annotations

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from torch import nn

from training.decoder import cache_kwarg, cache_of
from training.lora import DEFAULT_TARGET_MODULES, LoRAHost, MultiLoRALinear

RANK = 4
ALPHA = 8.0
ATOL = 1e-5


def random_adapter(host: LoRAHost, seed: int, rank: int = RANK) -> dict:
    gen = torch.Generator().manual_seed(seed)
    weights = {}
    for name, module in host.modules.items():
        a = torch.randn(rank, module.in_features, generator=gen) * 0.3
        b = torch.randn(module.out_features, rank, generator=gen) * 0.3
        weights[name] = (a, b)
    return weights


def peft_with(model: nn.Module, adapters: dict[str, dict]) -> PeftModel:
    config = LoraConfig(
        r=RANK, lora_alpha=ALPHA, target_modules=list(DEFAULT_TARGET_MODULES), lora_dropout=0.0
    )
    names = list(adapters)
    peft_model = get_peft_model(model, config, adapter_name=names[0])
    for name in names[1:]:
        peft_model.add_adapter(name, config)
    with torch.no_grad():
        for adapter_name, weights in adapters.items():
            for module_name, (a, b) in weights.items():
                layer = peft_model.base_model.model.get_submodule(module_name)
                layer.lora_A[adapter_name].weight.copy_(a)
                layer.lora_B[adapter_name].weight.copy_(b)
    return peft_model.eval()


def peft_logits(peft_model: PeftModel, adapter: str | None, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        if adapter is None:
            with peft_model.disable_adapter():
                return peft_model(input_ids=ids).logits
        peft_model.set_adapter(adapter)
        return peft_model(input_ids=ids).logits


# Both ways of computing several adapters in one batch: a loop over adapters and one grouped bmm.
STACK_MINS, STACK_IDS = [2, 1000], ["grouped-bmm", "loop"]
STACKING = pytest.mark.parametrize("stack_min", STACK_MINS, ids=STACK_IDS)


@pytest.fixture
def setup(tiny_model_factory, request):
    host_model = tiny_model_factory()
    stack_min = getattr(request, "param", 3)
    host = LoRAHost(host_model, DEFAULT_TARGET_MODULES, stack_min_adapters=stack_min)
    adapters = {f"p{i}": random_adapter(host, seed=i) for i in range(3)}
    for key, weights in adapters.items():
        host.register(key, weights, ALPHA / RANK)
    reference = peft_with(tiny_model_factory(), adapters)
    return host_model, host, reference


def test_it_wraps_only_the_target_linears(tiny_model):
    host = LoRAHost(tiny_model, ["q_proj", "v_proj"])
    assert sorted(host.module_names()) == sorted(
        f"model.layers.{i}.self_attn.{p}" for i in range(2) for p in ("q_proj", "v_proj")
    )
    assert isinstance(tiny_model.model.layers[0].self_attn.q_proj, MultiLoRALinear)
    assert isinstance(tiny_model.model.layers[0].self_attn.k_proj, nn.Linear)
    # State dict keys are unchanged, so saving the base model still works.
    assert "model.layers.0.self_attn.q_proj.weight" in tiny_model.state_dict()


def test_it_selects_all_linear_but_the_output_layer(tiny_model):
    host = LoRAHost(tiny_model, "all-linear")
    assert len(host.modules) == 2 * 7
    assert "lm_head" not in host.modules


@pytest.mark.parametrize("setup", STACK_MINS, ids=STACK_IDS, indirect=True)
def test_it_matches_peft_per_row_with_mixed_adapters(setup):
    host_model, host, reference = setup
    gen = torch.Generator().manual_seed(7)
    ids = torch.randint(3, 290, (6, 9), generator=gen)
    keys = ["p0", "p1", None, "p2", "p1", "p0"]
    with torch.no_grad(), host.route(keys):
        logits = host_model(input_ids=ids).logits
    for row, key in enumerate(keys):
        expected = peft_logits(reference, key, ids[row : row + 1])
        torch.testing.assert_close(logits[row : row + 1], expected, atol=ATOL, rtol=0)
    # The adapters really differ, so the comparison above is not vacuous.
    assert (logits[0] - logits[1]).abs().max() > 1e-2
    assert (logits[0] - logits[2]).abs().max() > 1e-2


# Rows laid out adapter by adapter (as a batch of several requests is): sliced, not gathered;
# equal groups in key order run the grouped bmm on a view of the batch.
GROUPED_LAYOUTS = [
    ["p0", "p0", "p1", "p1", "p2", "p2"],
    ["p0", "p1", "p1", "p1", None, "p2"],
    ["p2", "p2", "p0", "p0", "p1", "p0"],
]


@pytest.mark.parametrize("setup", STACK_MINS, ids=STACK_IDS, indirect=True)
@pytest.mark.parametrize("keys", GROUPED_LAYOUTS, ids=["equal", "unequal", "partly"])
def test_it_matches_peft_with_rows_grouped_by_adapter(setup, keys):
    host_model, host, reference = setup
    ids = torch.randint(3, 290, (6, 8), generator=torch.Generator().manual_seed(11))
    with torch.no_grad(), host.route(keys):
        logits = host_model(input_ids=ids).logits
    for row, key in enumerate(keys):
        expected = peft_logits(reference, key, ids[row : row + 1])
        torch.testing.assert_close(logits[row : row + 1], expected, atol=ATOL, rtol=0)


def test_it_keeps_stacked_copies_of_frozen_adapters_only_while_they_are_registered(
    tiny_model_factory,
):
    """Frozen adapters' stacked A/B are reused across calls; a key registered again with other
    weights, and live weights changed in place, are seen at once."""
    model = tiny_model_factory()
    host = LoRAHost(model, DEFAULT_TARGET_MODULES, stack_min_adapters=2)
    first = {f"p{i}": random_adapter(host, seed=i) for i in range(3)}
    for key, weights in first.items():
        host.register(key, weights, ALPHA / RANK, frozen=key != "p2")
    ids = torch.randint(3, 290, (6, 8), generator=torch.Generator().manual_seed(5))

    def check(adapters, keys):
        reference = peft_with(tiny_model_factory(), adapters)
        with torch.no_grad(), host.route(keys):
            out = model(input_ids=ids).logits
        for row, key in enumerate(keys):
            expected = peft_logits(reference, key, ids[row : row + 1])
            torch.testing.assert_close(out[row : row + 1], expected, atol=ATOL, rtol=0)

    frozen_keys = ["p0", "p0", "p0", "p1", "p1", "p1"]
    check(first, frozen_keys)
    assert ("p0", "p1") in host._state.stack_cache
    check(first, frozen_keys)  # served from the kept stacks
    # Same key, new weights: the kept stacks of that key are dropped.
    host.unregister("p1")
    assert ("p0", "p1") not in host._state.stack_cache
    second = {**first, "p1": random_adapter(host, seed=10)}
    host.register("p1", second["p1"], ALPHA / RANK, frozen=True)
    check(second, frozen_keys)
    # Live weights (p2 is not frozen) are stacked afresh each call: in-place changes show.
    live_keys = ["p0", "p0", "p2", "p2", "p1", "p1"]
    check(second, live_keys)
    with torch.no_grad():
        for _, b in second["p2"].values():
            b.mul_(-2.0)
    check(second, live_keys)


def test_it_matches_peft_when_every_row_uses_one_adapter(setup):
    host_model, host, reference = setup
    ids = torch.randint(3, 290, (3, 7), generator=torch.Generator().manual_seed(1))
    with torch.no_grad(), host.route(["p2"] * 3):
        logits = host_model(input_ids=ids).logits
    torch.testing.assert_close(logits, peft_logits(reference, "p2", ids), atol=ATOL, rtol=0)


@pytest.mark.parametrize("setup", STACK_MINS, ids=STACK_IDS, indirect=True)
def test_it_matches_peft_during_kv_cache_decoding(setup):
    host_model, host, reference = setup
    ids = torch.randint(3, 290, (4, 10), generator=torch.Generator().manual_seed(3))
    keys = ["p1", None, "p0", "p1"]
    prefill = 6
    with torch.no_grad(), host.route(keys):
        out = host_model(input_ids=ids[:, :prefill], use_cache=True)
        cache = cache_of(out)
        step_logits = [out.logits]
        for t in range(prefill, ids.shape[1]):
            out = host_model(
                input_ids=ids[:, t : t + 1], **{cache_kwarg(host_model): cache}, use_cache=True
            )
            cache = cache_of(out)
            step_logits.append(out.logits)
    logits = torch.cat(step_logits, dim=1)
    for row, key in enumerate(keys):
        expected = peft_logits(reference, key, ids[row : row + 1])
        torch.testing.assert_close(logits[row : row + 1], expected, atol=ATOL, rtol=0)


def test_it_uses_the_base_model_outside_a_route(setup, tiny_model_factory):
    host_model, _host, _ = setup
    plain = tiny_model_factory()
    ids = torch.randint(3, 290, (2, 5), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        torch.testing.assert_close(host_model(input_ids=ids).logits, plain(input_ids=ids).logits)


@STACKING
@pytest.mark.parametrize(
    "keys", [["a", "b", "b", "a"], ["a", "a", "b", "b"]], ids=["interleaved", "grouped"]
)
def test_it_backpropagates_into_several_adapters_in_one_forward(
    tiny_model_factory, stack_min, keys
):
    model = tiny_model_factory().requires_grad_(False)
    host = LoRAHost(model, DEFAULT_TARGET_MODULES, stack_min_adapters=stack_min)
    params = {}
    for key, seed in (("a", 1), ("b", 2)):
        weights = random_adapter(host, seed)
        params[key] = {
            name: (nn.Parameter(a.clone()), nn.Parameter(b.clone()))
            for name, (a, b) in weights.items()
        }
        host.register(key, params[key], 2.0)
    ids = torch.randint(3, 290, (4, 6), generator=torch.Generator().manual_seed(5))
    with host.route(keys):
        model(input_ids=ids).logits.square().mean(dim=(1, 2)).sum().backward()
    joint = {k: [t.grad.clone() for pair in p.values() for t in pair] for k, p in params.items()}
    for pairs in params.values():
        for pair in pairs.values():
            for t in pair:
                t.grad = None
    for key in ("a", "b"):
        rows = [i for i, k in enumerate(keys) if k == key]
        with host.route([key] * len(rows)):
            model(input_ids=ids[rows]).logits.square().mean(dim=(1, 2)).sum().backward()
        alone = [t.grad for pair in params[key].values() for t in pair]
        for g_joint, g_alone in zip(joint[key], alone, strict=True):
            torch.testing.assert_close(g_joint, g_alone, atol=1e-6, rtol=1e-5)
    assert all(p.grad is None for p in model.parameters())


@STACKING
def test_a_bf16_base_applies_fp32_adapters_in_bf16_and_trains_their_fp32_weights(
    tiny_model_factory, stack_min
):
    """A CUDA model is bf16 while adapters keep fp32 weights: the deltas are computed in the
    activations' dtype (the grouped bmm included, which once fell back to the loop whenever
    the dtypes differed), as with the same adapters cast to bf16, and gradients reach the
    fp32 weights."""
    reference = tiny_model_factory().to(torch.bfloat16).requires_grad_(False)
    model = tiny_model_factory().to(torch.bfloat16).requires_grad_(False)
    ref_host = LoRAHost(reference, DEFAULT_TARGET_MODULES, stack_min_adapters=stack_min)
    host = LoRAHost(model, DEFAULT_TARGET_MODULES, stack_min_adapters=stack_min)
    params = {}
    for key, seed in (("a", 1), ("b", 2)):
        weights = random_adapter(host, seed)
        in_bf16 = {n: (a.bfloat16(), b.bfloat16()) for n, (a, b) in weights.items()}
        ref_host.register(key, in_bf16, ALPHA / RANK, frozen=True)
        params[key] = {
            n: (nn.Parameter(a.clone()), nn.Parameter(b.clone())) for n, (a, b) in weights.items()
        }
        host.register(key, params[key], ALPHA / RANK)
    keys = ["a", "b", "b", "a"]
    ids = torch.randint(3, 290, (4, 6), generator=torch.Generator().manual_seed(5))
    with torch.no_grad(), ref_host.route(keys):
        expected = reference(input_ids=ids).logits
    with host.route(keys):
        logits = model(input_ids=ids).logits
        logits.float().square().mean().backward()
    assert logits.dtype == torch.bfloat16
    torch.testing.assert_close(logits, expected, atol=0, rtol=0)
    for pairs in params.values():
        for a, b in pairs.values():
            assert a.grad is not None and a.grad.dtype == torch.float32
            assert b.grad is not None and b.grad.abs().sum() > 0
    # Frozen fp32 adapters on the bf16 base: stacked once, in bf16, with the same result.
    for key in ("a", "b"):
        host.unregister(key)
        frozen = {n: (a.detach(), b.detach()) for n, (a, b) in params[key].items()}
        host.register(key, frozen, ALPHA / RANK, frozen=True)
    with torch.no_grad(), host.route(keys):
        again = model(input_ids=ids).logits
    torch.testing.assert_close(again, expected, atol=0, rtol=0)
    if stack_min == 2:
        stacks = host._state.stack_cache[("a", "b")]
        assert stacks and all(a.dtype == torch.bfloat16 for a, _b in stacks.values())


def test_it_rejects_unknown_keys_and_bad_shapes(tiny_model):
    host = LoRAHost(tiny_model, ["q_proj"])
    name = "model.layers.0.self_attn.q_proj"
    with pytest.raises(KeyError, match="not registered"), host.route(["missing"]):
        pass
    with pytest.raises(ValueError, match="A has shape"):
        host.register("x", {name: (torch.zeros(4, 3), torch.zeros(64, 4))}, 1.0)
    with pytest.raises(ValueError, match="B has shape"):
        host.register("x", {name: (torch.zeros(4, 64), torch.zeros(64, 5))}, 1.0)
    with pytest.raises(KeyError, match="not a module wrapped"):
        host.register("x", {"model.layers.0.mlp.up_proj": (torch.zeros(4, 64), None)}, 1.0)
    host.register("x", {name: (torch.zeros(4, 64), torch.zeros(64, 4))}, 1.0)
    with pytest.raises(KeyError, match="already registered"):
        host.register("x", {name: (torch.zeros(4, 64), torch.zeros(64, 4))}, 1.0)
    with pytest.raises(RuntimeError, match="rows"), torch.no_grad(), host.route(["x", None]):
        tiny_model(input_ids=torch.ones(3, 2, dtype=torch.long))
    host.unregister("x")
    assert "x" not in host
    with pytest.raises(KeyError):
        host.unregister("x")


def test_it_mixes_adapters_of_different_ranks_and_targets(tiny_model_factory):
    model = tiny_model_factory()
    host = LoRAHost(model, DEFAULT_TARGET_MODULES, stack_min_adapters=2)
    full = random_adapter(host, seed=1, rank=4)
    host.register("r4", full, 2.0)
    host.register("r2", random_adapter(host, seed=2, rank=2), 1.5)
    host.register("qv", {k: v for k, v in full.items() if k.endswith(("q_proj", "v_proj"))}, 2.0)
    ids = torch.randint(3, 290, (5, 6), generator=torch.Generator().manual_seed(6))
    keys = ["qv", "r4", "r2", None, "r4"]
    with torch.no_grad():
        with host.route(keys):
            mixed = model(input_ids=ids).logits
        for row, key in enumerate(keys):
            with host.route([key]):
                alone = model(input_ids=ids[row : row + 1]).logits
            torch.testing.assert_close(mixed[row : row + 1], alone, atol=ATOL, rtol=0)
    assert (mixed[0] - mixed[1]).abs().max() > 1e-2
