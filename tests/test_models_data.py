import math

import pytest
import torch
from torch import nn

from zerodp.demo.data import (
    TokenBatches,
    decode,
    encode,
    get_batch,
    load_corpus,
    load_splits,
    split_tokens,
)
from zerodp.demo.models import GPT, PRESETS, GPTConfig, gpt_config


def _owns_params(module: nn.Module) -> bool:
    return next(module.parameters(recurse=False), None) is not None


def _replay_reset(model: nn.Module) -> None:
    # The materialisation contract: reset_parameters() of every module that owns
    # parameters, in modules() order (see models.py, [Note: initialisation ...]).
    for module in model.modules():
        if _owns_params(module):
            module.reset_parameters()


def _assert_bitwise_equal(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for name, value in a.items():
        assert value.dtype == b[name].dtype, name
        assert torch.equal(value, b[name]), name


# ---------------------------------------------------------------- models


@pytest.mark.parametrize("preset", ["tiny", "small"])
def test_meta_materialisation_is_bitwise_equal_to_eager(preset):
    torch.manual_seed(1234)
    eager = GPT(preset)

    torch.manual_seed(1234)
    with torch.device("meta"):
        lazy = GPT(preset)
    assert lazy.transformer.wte.weight.is_meta
    lazy.to_empty(device="cpu")
    _replay_reset(lazy)

    _assert_bitwise_equal(eager.state_dict(), lazy.state_dict())
    assert lazy.lm_head.weight is lazy.transformer.wte.weight


def test_plain_to_empty_unties_and_tie_weights_restores():
    torch.manual_seed(7)
    eager = GPT("tiny")
    torch.manual_seed(7)
    with torch.device("meta"):
        lazy = GPT("tiny")
    # nn.Module.to_empty makes one new Parameter per owning module: the tie breaks.
    nn.Module.to_empty(lazy, device="cpu")
    assert lazy.lm_head.weight is not lazy.transformer.wte.weight
    lazy.tie_weights()
    _replay_reset(lazy)
    _assert_bitwise_equal(eager.state_dict(), lazy.state_dict())


def test_every_module_with_params_can_reset():
    model = GPT("tiny")
    for module in model.modules():
        if _owns_params(module):
            assert callable(getattr(module, "reset_parameters", None)), type(module)


def test_lm_head_is_tied_to_token_embedding():
    model = GPT("tiny")
    assert model.lm_head.weight is model.transformer.wte.weight
    names = [n for n, _ in model.named_parameters()]
    assert "lm_head.weight" not in names  # counted once, under the embedding
    assert model.num_params() == sum(p.numel() for p in model.parameters())
    model.to(torch.float64)
    assert model.lm_head.weight is model.transformer.wte.weight


def test_forward_shapes_and_initial_loss():
    torch.manual_seed(0)
    cfg = PRESETS["tiny"]
    model = GPT(cfg)
    idx = torch.randint(cfg.vocab_size, (3, cfg.block_size))
    logits, loss = model(idx)
    assert logits.shape == (3, cfg.block_size, cfg.vocab_size)
    assert loss is None
    targets = torch.randint(cfg.vocab_size, (3, cfg.block_size))
    _, loss = model(idx, targets)
    assert loss.shape == ()
    # Near-uniform predictions at init: loss close to ln(vocab). (Targets equal
    # to the inputs would score better: the tied head favours the input token.)
    assert abs(loss.item() - math.log(cfg.vocab_size)) < 0.1


def test_bf16_forward_backward_has_fp32_loss():
    torch.manual_seed(0)
    model = GPT("tiny").to(torch.bfloat16)
    assert model.lm_head.weight is model.transformer.wte.weight
    idx = torch.randint(256, (2, 16))
    logits, loss = model(idx, idx)
    assert logits.dtype == torch.bfloat16
    assert loss.dtype == torch.float32 and torch.isfinite(loss)
    loss.backward()
    assert model.transformer.wte.weight.grad.dtype == torch.bfloat16


def test_sequence_longer_than_block_size_raises():
    model = GPT("tiny")
    with pytest.raises(ValueError, match="block_size=32"):
        model(torch.zeros(1, 33, dtype=torch.long))


@pytest.mark.parametrize(
    "name, low, high",
    [("tiny", 2e4, 8e4), ("small", 1e6, 5e6), ("20m", 15e6, 25e6), ("120m", 110e6, 130e6)],
)
def test_preset_parameter_counts(name, low, high):
    with torch.device("meta"):
        model = GPT(name)
    assert low <= model.num_params() <= high


def test_generate_is_deterministic_and_top1_is_greedy():
    torch.manual_seed(0)
    model = GPT("tiny").eval()
    prompt = torch.tensor([[72, 105]])
    a = model.generate(prompt, 40, top_k=5, generator=torch.Generator().manual_seed(3))
    b = model.generate(prompt, 40, top_k=5, generator=torch.Generator().manual_seed(3))
    assert a.shape == (1, 42) and torch.equal(a, b)
    greedy = model.generate(prompt, 5, top_k=1)
    expected = prompt
    for _ in range(5):
        logits, _ = model(expected[:, -model.config.block_size :])
        expected = torch.cat((expected, logits[:, -1].argmax(-1, keepdim=True)), dim=1)
    assert torch.equal(greedy, expected)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"n_embd": 30, "n_head": 4}, "n_embd=30"),
        ({"n_layer": 0}, "n_layer=0"),
        ({"vocab_size": -1}, "vocab_size=-1"),
        ({"block_size": 2.5}, "block_size=2.5"),
    ],
)
def test_bad_config_raises(kwargs, match):
    with pytest.raises(ValueError, match=match):
        GPTConfig(**kwargs)


def test_unknown_preset_lists_presets():
    with pytest.raises(ValueError, match="'huge'.*tiny"):
        gpt_config("huge")
    assert gpt_config(PRESETS["small"]) is PRESETS["small"]


def test_bad_generate_arguments_raise():
    model = GPT("tiny")
    with pytest.raises(ValueError, match="temperature=0"):
        model.generate(torch.zeros(1, 1, dtype=torch.long), 1, temperature=0)


# ---------------------------------------------------------------- data


def test_corpus_is_real_english():
    text = load_corpus()
    assert isinstance(text, bytes) and len(text) > 200_000
    words = text.decode("ascii").lower().split()
    assert "devil's" in words and "dictionary" in words
    for common in ("the", "and", "of", "to", "a", "in", "is", "that"):
        assert words.count(common) > 500, common


def test_encode_decode_round_trip():
    text = "Cynic, n.  A blackguard. \u00e9\u2014"
    ids = encode(text)
    assert ids.dtype == torch.int64 and int(ids.max()) < 256
    assert decode(ids) == text
    assert decode([0x66, 0xFF, 0x6F]) == "f\ufffdo"
    assert torch.equal(encode(b"ab"), torch.tensor([97, 98]))


def test_splits_are_contiguous_90_10():
    splits = load_splits()
    tokens = encode(load_corpus())
    assert len(splits.train) + len(splits.val) == len(tokens)
    assert abs(len(splits.val) / len(tokens) - 0.1) < 1e-3
    assert torch.equal(torch.cat((splits.train, splits.val)), tokens)


def test_batches_are_deterministic_and_shifted():
    splits = load_splits()
    x1, y1 = get_batch(splits, "train", 4, 64, torch.Generator().manual_seed(5))
    x2, y2 = get_batch(splits, "train", 4, 64, torch.Generator().manual_seed(5))
    assert x1.dtype == y1.dtype == torch.int64 and x1.shape == (4, 64)
    assert torch.equal(x1, x2) and torch.equal(y1, y2)
    assert torch.equal(x1[:, 1:], y1[:, :-1])
    x3, _ = get_batch(splits, "val", 4, 64, torch.Generator().manual_seed(5))
    assert not torch.equal(x1, x3)


def test_rank_batches_are_slices_of_the_global_batch():
    splits = load_splits()
    batch, block, world = 3, 16, 4
    reference = torch.Generator().manual_seed(11)
    ranks = [torch.Generator().manual_seed(11) for _ in range(world)]
    for _step in range(3):  # generators stay in lockstep across steps
        gx, gy = get_batch(splits, "train", batch * world, block, reference)
        for r in range(world):
            x, y = get_batch(splits, "train", batch, block, ranks[r], rank=r, world_size=world)
            assert torch.equal(x, gx[r * batch : (r + 1) * batch])
            assert torch.equal(y, gy[r * batch : (r + 1) * batch])


def test_token_batches_matches_get_batch():
    splits = load_splits()
    it = TokenBatches(splits, "train", 2, 8, seed=9, rank=1, world_size=2)
    g = torch.Generator().manual_seed(9)
    for _ in range(2):
        x, y = next(it)
        ex, ey = get_batch(splits, "train", 2, 8, g, rank=1, world_size=2)
        assert torch.equal(x, ex) and torch.equal(y, ey)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"batch_size": 0}, "batch_size=0"),
        ({"block_size": 0}, "block_size=0"),
        ({"rank": 2, "world_size": 2}, "rank=2"),
        ({"block_size": 100}, "block_size=100"),
        ({"split": "test"}, "split='test'"),
    ],
)
def test_bad_batch_arguments_raise(kwargs, match):
    splits = split_tokens(torch.arange(100) % 256)
    args = {"split": "train", "batch_size": 2, "block_size": 8, "rank": 0, "world_size": 1} | kwargs
    with pytest.raises(ValueError, match=match):
        get_batch(splits, generator=torch.Generator(), **args)


def test_bad_val_fraction_raises():
    with pytest.raises(ValueError, match="val_fraction=1.0"):
        split_tokens(torch.arange(10), 1.0)
