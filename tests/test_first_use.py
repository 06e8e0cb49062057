"""What a user meets first (issue 22, items 13 and 21): the README's disk-offload recipe
trains, and a model built under `zerodp.init` but used before `zerodp.initialize` says what
is wrong and what to do. Single process: both happen before any rank talks to another."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import zerodp


def tapered() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 4))


def train(config: zerodp.Config, steps: int = 3) -> tuple[list[float], list[torch.Tensor]]:
    """Losses and final parameters of `steps` plain SGD steps on one batch."""
    model, opt = zerodp.initialize(tapered(), torch.optim.SGD, config, lr=0.1)
    data = torch.Generator().manual_seed(1)
    x, y = torch.randn(4, 8, generator=data), torch.randn(4, 4, generator=data)
    losses = []
    for _ in range(steps):
        loss = (model(x) - y).square().mean()
        opt.backward(loss)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    with zerodp.gathered_parameters(model):
        params = [p.detach().clone() for p in model.parameters()]
    return losses, params


def test_disk_offload_with_a_root_that_owns_no_parameter_trains_as_without_offload(tmp_path):
    """`unit_modules=(nn.Linear,)` leaves the root no trainable parameter; its unit still
    keeps a one-element shard, which the disk reservation did not count ("offload arena
    ... the reservation undercounted" at initialize). The offloaded run computes the same
    operations on the same flat shards as the one in memory, only stored in files, so the
    two are equal bit for bit."""
    recipe = dict(stage=3, unit_modules=(nn.Linear,))
    plain = train(zerodp.Config(**recipe))
    on_disk = train(zerodp.Config(**recipe, offload_optimizer="disk", offload_params="disk",
                                  offload_dir=str(tmp_path)))
    assert on_disk[0] == plain[0]
    assert all(torch.equal(a, b) for a, b in zip(on_disk[1], plain[1]))
    assert plain[0][-1] < plain[0][0]  # it trained


def built_under_init() -> nn.Module:
    with zerodp.init(zerodp.Config(stage=3)):
        return tapered()


def test_a_model_built_under_init_and_run_before_initialize_says_so():
    model = built_under_init()
    with pytest.raises(RuntimeError, match=r"Sequential was built under zerodp.init, so its parameters are on the "
                                           r"meta device.*call zerodp.initialize before running it"):
        model(torch.randn(2, 8))
    with pytest.raises(RuntimeError, match=r"Linear was built under zerodp.init"):  # a submodule called alone
        model[0](torch.randn(2, 8))
    # torch only warns that loading into a meta tensor does nothing; initialize would then
    # draw fresh values over the weights the user meant to load.
    with pytest.raises(RuntimeError, match="before loading weights into it.*zerodp.load_pretrained"):
        model.load_state_dict(tapered().state_dict())
    assert model(torch.randn(2, 8, device="meta")).shape == (2, 4)  # shape tracing on meta stays allowed


def test_the_guard_goes_once_the_model_is_real():
    model, _ = zerodp.initialize(built_under_init(), torch.optim.SGD, zerodp.Config(stage=2), lr=0.1)
    assert model(torch.randn(2, 8)).shape == (2, 4)
    assert not model[0]._forward_pre_hooks  # removed at initialize, not just idle
    model.load_state_dict(tapered().state_dict())  # loading weights is what comes after initialize
    assert torch.equal(model[0].weight, tapered()[0].weight)
    # Materialised by the user (`load_state_dict(assign=True)`): usable, and the guard leaves.
    model = built_under_init()
    model.load_state_dict(tapered().state_dict(), assign=True)
    assert torch.equal(model(torch.ones(1, 8)), tapered()(torch.ones(1, 8)))
    assert not model[0]._forward_pre_hooks
