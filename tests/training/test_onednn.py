"""The oneDNN projection path: same results as F.linear, repacked on change, no-grad only."""

from __future__ import annotations

import gc

import pytest
import torch
import torch.nn.functional as F

from training import onednn

pytestmark = pytest.mark.skipif(
    not onednn.available(), reason="this torch build has no usable oneDNN packed linear"
)


def _close(got: torch.Tensor, expected: torch.Tensor) -> None:
    torch.testing.assert_close(got, expected, atol=1e-5 * expected.abs().max().item(), rtol=0)


@pytest.mark.parametrize(
    "x",
    [torch.randn(64, 1, 96), torch.randn(4, 7, 96), torch.randn(7, 4, 96).transpose(0, 1)],
    ids=["decode", "prefill", "strided"],
)
@pytest.mark.parametrize("with_bias", [False, True])
def test_it_equals_f_linear(x, with_bias):
    weight = torch.randn(80, 96)
    bias = torch.randn(80) if with_bias else None
    with torch.no_grad():
        assert onednn.usable(x, weight)
        _close(onednn.linear(x, weight, bias), F.linear(x, weight, bias))


def test_it_repacks_a_weight_changed_in_place_and_forgets_a_freed_one():
    weight = torch.randn(32, 16)
    x = torch.randn(3, 16)
    with torch.no_grad():
        first = onednn.linear(x, weight, None)
        weight.mul_(-3.0)
        _close(onednn.linear(x, weight, None), first * -3.0)
    key = (id(weight),)
    assert key in onednn._packed
    del weight
    gc.collect()
    assert key not in onednn._packed


def test_stacked_rows_equal_the_projections_side_by_side_and_follow_their_changes():
    # A layer's query, key and value: unequal heights, biases on two of the three.
    weights = [torch.randn(40, 96), torch.randn(16, 96), torch.randn(16, 96)]
    biases = [torch.randn(40), None, torch.randn(16)]
    x = torch.randn(5, 1, 96)

    def side_by_side() -> torch.Tensor:
        return torch.cat([F.linear(x, w, b) for w, b in zip(weights, biases)], dim=-1)

    with torch.no_grad():
        _close(onednn.linear_rows(x, weights, biases), side_by_side())
        # Full fine-tuning changes weights and biases in place: both are repacked.
        weights[1].mul_(-2.0)
        biases[2].add_(1.0)
        _close(onednn.linear_rows(x, weights, biases), side_by_side())
    key = tuple(id(w) for w in weights)
    bias_key = ("bias", *key, *(id(b) if b is not None else 0 for b in biases))
    assert key in onednn._packed and bias_key in onednn._biases
    del weights[1]  # one of them freed: the stacked copies go with it
    gc.collect()
    assert key not in onednn._packed and bias_key not in onednn._biases


def test_it_leaves_autograd_and_other_dtypes_to_f_linear():
    weight = torch.randn(8, 6, requires_grad=True)
    x = torch.randn(2, 6, requires_grad=True)
    assert not onednn.usable(x, weight)  # grad mode
    onednn.linear(x, weight, None).sum().backward()
    torch.testing.assert_close(weight.grad, x.detach().sum(0).expand(8, 6))
    with torch.no_grad():
        assert not onednn.usable(x.double(), weight.double())


def test_it_can_be_switched_off(monkeypatch):
    monkeypatch.setenv("OPENTINKER_ONEDNN_LINEAR", "0")
    monkeypatch.delitem(onednn._state, "ok", raising=False)  # restored after the test
    assert not onednn.available()
    with torch.no_grad():
        assert not onednn.usable(torch.randn(2, 4), torch.randn(3, 4))
