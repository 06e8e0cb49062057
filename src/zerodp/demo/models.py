"""A small GPT-2 style decoder-only transformer, used as the workload for zerodp.

The architecture follows GPT-2 (Radford et al., 2019): learned token and
position embeddings, pre-LayerNorm blocks of causal self-attention and a 4x MLP,
a final LayerNorm, and an output head tied to the token embedding.

[Note: initialisation lives in reset_parameters]
Every module initialises its own parameters in ``reset_parameters()``, which its
constructor calls; ``GPT.__init__`` runs no second initialisation pass. A model
built on the meta device can therefore be materialised by ``to_empty()``
followed by calling ``reset_parameters()`` on each module that owns parameters
(``module.parameters(recurse=False)``), in ``model.modules()`` order. Because
construction order equals registration order, that replay draws from the RNG
in the same sequence as eager construction, so under the same
``torch.manual_seed`` both give bitwise-identical weights. The tied output head
owns no initialisation of its own (its ``reset_parameters`` is a no-op), so the
shared weight is drawn exactly once, by the embedding.

[Note: to_empty unties the output head]
``Module.to_empty`` builds a new ``Parameter`` per owning module, so after it
``lm_head.weight`` and ``transformer.wte.weight`` are different objects.
``GPT.to_empty`` re-ties them; code that calls ``to_empty`` on submodules
instead must call ``GPT.tie_weights()`` afterwards.
"""

from __future__ import annotations

import functools
import logging
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import nn

logger = logging.getLogger(__name__)

# GPT-2 initialises weights from N(0, 0.02) (Radford et al., 2019; nanoGPT).
INIT_STD = 0.02


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 256
    """Number of token ids; 256 for the byte-level corpus in ``zerodp.demo.data``."""
    block_size: int = 128
    """Longest sequence the position embedding covers."""
    n_layer: int = 4
    """Number of transformer blocks."""
    n_head: int = 4
    """Attention heads per block; must divide ``n_embd``."""
    n_embd: int = 128
    """Width of the residual stream."""
    bias: bool = True
    """Whether Linear and LayerNorm layers carry a bias, as in GPT-2."""

    def __post_init__(self) -> None:
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"GPTConfig.{name}={value!r}: must be a positive int")
        if self.n_embd % self.n_head != 0:
            raise ValueError(
                f"GPTConfig.n_embd={self.n_embd} is not divisible by n_head={self.n_head}: "
                "pick n_head that divides n_embd"
            )


PRESETS: dict[str, GPTConfig] = {
    # ~35k parameters: fast enough for multi-rank CPU tests.
    "tiny": GPTConfig(vocab_size=256, block_size=32, n_layer=2, n_head=2, n_embd=32),
    # ~1.9M parameters, byte-level: a CPU demo that learns in minutes.
    "small": GPTConfig(vocab_size=256, block_size=128, n_layer=4, n_head=4, n_embd=192),
    # ~19M parameters, byte-level.
    "20m": GPTConfig(vocab_size=256, block_size=256, n_layer=6, n_head=8, n_embd=512),
    # ~124M parameters: GPT-2 small, vocabulary padded to a multiple of 64 as nanoGPT does.
    "120m": GPTConfig(vocab_size=50304, block_size=1024, n_layer=12, n_head=12, n_embd=768),
}


def gpt_config(name_or_cfg: str | GPTConfig) -> GPTConfig:
    """Return ``name_or_cfg`` if it is a config, else the preset of that name."""
    if isinstance(name_or_cfg, GPTConfig):
        return name_or_cfg
    if name_or_cfg not in PRESETS:
        raise ValueError(
            f"unknown model preset {name_or_cfg!r}: choose one of {sorted(PRESETS)} "
            "or pass a GPTConfig"
        )
    return PRESETS[name_or_cfg]


class NormalEmbedding(nn.Embedding):
    """Embedding initialised from N(0, 0.02), as GPT-2 does."""

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, mean=0.0, std=INIT_STD)


class NormalLinear(nn.Linear):
    """Linear layer initialised from N(0, std) with a zero bias, as GPT-2 does."""

    def __init__(self, in_features: int, out_features: int, bias: bool, std: float = INIT_STD):
        # Set before nn.Linear.__init__, which calls reset_parameters().
        self.init_std = std
        super().__init__(in_features, out_features, bias=bias)

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, mean=0.0, std=self.init_std)
        if self.bias is not None:
            nn.init.zeros_(self.bias)


class TiedLinear(nn.Linear):
    """Bias-free output head whose weight is another module's Parameter.

    ``reset_parameters`` does nothing: the weight belongs to, and is initialised
    by, the token embedding (see [Note: initialisation lives in reset_parameters]).
    """

    def __init__(self, weight: nn.Parameter):
        vocab_size, n_embd = weight.shape
        super().__init__(n_embd, vocab_size, bias=False, device="meta")
        self.weight = weight

    def reset_parameters(self) -> None:
        pass


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.n_head = cfg.n_head
        self.head_dim = cfg.n_embd // cfg.n_head
        self.c_attn = NormalLinear(cfg.n_embd, 3 * cfg.n_embd, bias=cfg.bias)
        # GPT-2 scales residual projections by 1/sqrt(number of residual layers),
        # two per block, so the residual stream's variance stays bounded with depth.
        self.c_proj = NormalLinear(
            cfg.n_embd, cfg.n_embd, bias=cfg.bias, std=INIT_STD / math.sqrt(2 * cfg.n_layer)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        # Heads counted from the projection's width, not the config: under tensor parallelism
        # a rank holds a slice of them ([Note: tensor-parallel layers]).
        q, k, v = self.c_attn(x).chunk(3, dim=2)
        # (B, T, heads * head_dim) -> (B, heads, T, head_dim)
        q, k, v = (z.view(b, t, -1, self.head_dim).transpose(1, 2) for z in (q, k, v))
        y = self.attend(q, k, v)
        return self.c_proj(y.transpose(1, 2).contiguous().view(b, t, -1))

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Causal attention over (B, heads, T, head_dim); sequence parallelism sets its own on
        the instance (zerodp/sequence_parallel/inputs.py)."""
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.c_fc = NormalLinear(cfg.n_embd, 4 * cfg.n_embd, bias=cfg.bias)
        self.c_proj = NormalLinear(
            4 * cfg.n_embd, cfg.n_embd, bias=cfg.bias, std=INIT_STD / math.sqrt(2 * cfg.n_layer)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))


class Block(nn.Module):
    """Pre-LayerNorm transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    # Activation checkpointing as Hugging Face layers have it: `GPT.gradient_checkpointing_enable`
    # sets both, and zerodp's partitioned checkpoints (Pa) wrap `_gradient_checkpointing_func`.
    gradient_checkpointing = False
    _gradient_checkpointing_func = None

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        # Construction order must equal registration order: see
        # [Note: initialisation lives in reset_parameters].
        self.ln_1 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    # Megatron's split for zerodp.Config(tensor_parallel_size=...) ([Note: tensor-parallel
    # layers]): module name pattern -> how it is split.
    tensor_parallel_plan = {
        "transformer.wte": "embedding",
        "transformer.h.*.attn.c_attn": "colwise_packed3",  # q, k and v, each split by heads
        "transformer.h.*.attn.c_proj": "rowwise",
        "transformer.h.*.mlp.c_fc": "colwise",
        "transformer.h.*.mlp.c_proj": "rowwise",
        "lm_head": "lm_head",
    }

    def __init__(self, cfg: GPTConfig | str):
        super().__init__()
        cfg = gpt_config(cfg)
        self.config = cfg
        self.transformer = nn.ModuleDict(
            {
                "wte": NormalEmbedding(cfg.vocab_size, cfg.n_embd),
                "wpe": NormalEmbedding(cfg.block_size, cfg.n_embd),
                "h": nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer)),
                "ln_f": nn.LayerNorm(cfg.n_embd, bias=cfg.bias),
            }
        )
        # Weight tying (Press & Wolf, 2017), as in GPT-2: one Parameter, two modules.
        self.lm_head = TiedLinear(self.transformer.wte.weight)

    def gradient_checkpointing_enable(self, gradient_checkpointing_kwargs: dict | None = None) -> None:
        """Recompute each block in backward instead of keeping its activations (only its input
        is kept), with torch.utils.checkpoint; the same call as on a Hugging Face model.
        `use_reentrant` defaults to False, as torch recommends."""
        kwargs = {"use_reentrant": False, **(gradient_checkpointing_kwargs or {})}
        for block in self.transformer.h:
            block.gradient_checkpointing = True
            block._gradient_checkpointing_func = functools.partial(torch.utils.checkpoint.checkpoint, **kwargs)

    def tie_weights(self) -> None:
        """Point ``lm_head.weight`` at the token embedding's Parameter again."""
        self.lm_head.weight = self.transformer.wte.weight

    def to_empty(self, *, device: torch.device | str | None, recurse: bool = True) -> GPT:
        # See [Note: to_empty unties the output head].
        super().to_empty(device=device, recurse=recurse)
        self.tie_weights()
        return self

    def num_params(self, non_embedding: bool = False) -> int:
        """Number of distinct parameters (the tied weight counts once).

        With ``non_embedding=True`` the position embedding is left out, as in
        nanoGPT; the token embedding stays in because the head reuses it.
        """
        n = sum(p.numel() for p in self.parameters())
        if non_embedding:
            n -= self.transformer.wpe.weight.numel()
        return n

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Return ``(logits, loss)``; ``loss`` is None when ``targets`` is None."""
        b, t = idx.shape
        if t > self.config.block_size:
            raise ValueError(
                f"sequence length {t} exceeds block_size={self.config.block_size}: "
                "crop the input or build the model with a larger block_size"
            )
        pos = torch.arange(t, device=idx.device)
        x = self.transformer.wte(idx) + self.transformer.wpe(pos)
        for block in self.transformer.h:
            if block.gradient_checkpointing and self.training and torch.is_grad_enabled():
                x = block._gradient_checkpointing_func(block.__call__, x)
            else:
                x = block(x)
        logits = self.lm_head(self.transformer.ln_f(x))
        if targets is None:
            return logits, None
        loss = self.loss_function(logits=logits, labels=targets, vocab_size=self.config.vocab_size,
                                  shift_labels=targets)
        return logits, loss

    def loss_function(self, logits: torch.Tensor, labels: torch.Tensor, vocab_size: int | None = None,
                      shift_labels: torch.Tensor | None = None, **kwargs) -> torch.Tensor:
        """The loss of `forward`, with the signature of transformers' loss functions (the
        targets come already shifted, as `shift_labels`), so that one taking its place on
        an instance works here as on a Hugging Face model (e.g. the vocabulary-parallel
        loss of zerodp.tensor_parallel.keep_logits_split)."""
        target = labels if shift_labels is None else shift_labels
        # Softmax cross-entropy in fp32: in bf16/fp16 the log-sum-exp over the
        # vocabulary loses the precision that small loss differences need.
        return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), target.reshape(-1))

    @torch.no_grad()
    def generate(
        self,
        idx: torch.Tensor,
        max_new_tokens: int,
        temperature: float = 1.0,
        top_k: int | None = None,
        generator: torch.Generator | None = None,
    ) -> torch.Tensor:
        """Sample ``max_new_tokens`` tokens after ``idx`` (shape (B, T)), autoregressively."""
        if temperature <= 0:
            raise ValueError(f"temperature={temperature}: must be > 0")
        if top_k is not None and top_k < 1:
            raise ValueError(f"top_k={top_k}: must be >= 1 or None")
        for _ in range(max_new_tokens):
            context = idx[:, -self.config.block_size :]
            logits, _ = self(context)
            logits = logits[:, -1, :].float() / temperature
            if top_k is not None:
                kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, -1:]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            probs = F.softmax(logits, dim=-1)
            next_id = torch.multinomial(probs, num_samples=1, generator=generator)
            idx = torch.cat((idx, next_id), dim=1)
        return idx
