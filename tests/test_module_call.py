"""llmserve's Module: straight to forward without hooks, nn.Module's call with them."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from llmserve.layers.module import Module


class Doubler(Module):
    def forward(self, x):
        return 2 * x


@pytest.fixture
def counted_call_impl(monkeypatch):
    """How many times nn.Module's call machinery ran."""
    calls = []
    original = nn.Module._call_impl

    def call_impl(self, *args, **kwargs):
        calls.append(type(self).__name__)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(nn.Module, "_call_impl", call_impl)
    return calls


def test_a_module_without_hooks_skips_nn_modules_call(counted_call_impl):
    x = torch.ones(3)
    assert torch.equal(Doubler()(x), 2 * x)
    assert counted_call_impl == []
    nn.Identity()(x)  # a torch module still goes through it
    assert counted_call_impl == ["Identity"]


def test_forward_hooks_of_its_own_still_run(counted_call_impl):
    module, seen = Doubler(), []
    pre = module.register_forward_pre_hook(lambda m, args: (args[0] + 1,))
    post = module.register_forward_hook(lambda m, args, out: seen.append(out) or out * 10)
    assert torch.equal(module(torch.ones(2)), torch.full((2,), 40.0))
    assert len(seen) == 1 and counted_call_impl == ["Doubler"]
    pre.remove(), post.remove()
    assert torch.equal(module(torch.ones(2)), torch.full((2,), 2.0))
    assert counted_call_impl == ["Doubler"]


def test_global_forward_hooks_still_run():
    seen = []
    handle = nn.modules.module.register_module_forward_hook(
        lambda m, args, out: seen.append(type(m).__name__)
    )
    try:
        Doubler()(torch.ones(1))
    finally:
        handle.remove()
    assert seen == ["Doubler"]
