"""Reference decoder-only language models in plain torch.

One :class:`Decoder` covers the GPT-2, Llama, OPT and BLOOM families; a frozen
:class:`DecoderConfig` picks the normalisation, MLP, position encoding, biases
and embedding tying.  The model is written so that ``torch.export.export`` with
a dynamic batch and sequence length traces it without specialising either size:
every shape is read from the input tensor or left as ``-1``, and every
sequence-dependent constant (rotary tables, ALiBi bias, causal mask) is built
from ``arange`` inside ``forward``.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

logger = logging.getLogger(__name__)

NORMS = ("layernorm", "rmsnorm")
MLPS = ("gelu", "relu", "swiglu")
POSITIONS = ("learned", "rotary", "alibi")


@dataclass(frozen=True, slots=True, kw_only=True)
class DecoderConfig:
    """Architecture of a decoder-only LM.

    ``kv_heads`` defaults to ``heads`` (plain multi-head attention); a smaller
    divisor of ``heads`` gives grouped-query attention.

    ``fused_qkv`` computes queries, keys and values with one ``qkv_proj`` linear
    (hidden -> 3 * hidden) whose output is laid out per head as ``(heads, 3, head_dim)``,
    Megatron-LM's interleaved layout (GPT-2 and BLOOM fuse QKV; Llama and OPT do not).
    It needs plain multi-head attention (``kv_heads == heads``).
    """

    name: str
    vocab_size: int
    hidden: int
    layers: int
    heads: int
    kv_heads: int | None = None
    ffn_hidden: int
    fused_qkv: bool = False
    norm: str = "layernorm"
    mlp: str = "gelu"
    position: str = "learned"
    bias: bool = True
    tied_embeddings: bool = True
    max_seq: int = 2048
    embed_norm: bool = False
    norm_eps: float = 1e-5
    dropout: float = 0.0
    rope_theta: float = 10000.0
    description: str = ""

    def __post_init__(self) -> None:
        if self.kv_heads is None:
            object.__setattr__(self, "kv_heads", self.heads)
        for field_name in ("vocab_size", "hidden", "layers", "heads", "kv_heads", "ffn_hidden", "max_seq"):
            value = getattr(self, field_name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"DecoderConfig {self.name!r}: {field_name} must be a positive int, got {value!r}")
        if self.hidden % self.heads:
            raise ValueError(
                f"DecoderConfig {self.name!r}: hidden ({self.hidden}) must be divisible by heads ({self.heads})"
            )
        if self.heads % self.kv_heads:
            raise ValueError(
                f"DecoderConfig {self.name!r}: heads ({self.heads}) must be divisible by kv_heads ({self.kv_heads})"
            )
        if not isinstance(self.fused_qkv, bool):
            raise ValueError(f"DecoderConfig {self.name!r}: fused_qkv must be a bool, got {self.fused_qkv!r}")
        if self.fused_qkv and self.kv_heads != self.heads:
            raise ValueError(
                f"DecoderConfig {self.name!r}: fused_qkv needs kv_heads == heads, "
                f"got kv_heads={self.kv_heads}, heads={self.heads}"
            )
        self._check_choice("norm", self.norm, NORMS)
        self._check_choice("mlp", self.mlp, MLPS)
        self._check_choice("position", self.position, POSITIONS)
        if self.position == "rotary" and self.head_dim % 2:
            raise ValueError(
                f"DecoderConfig {self.name!r}: rotary positions need an even head_dim, got {self.head_dim}"
            )
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"DecoderConfig {self.name!r}: dropout must be in [0, 1), got {self.dropout}")
        if self.norm_eps <= 0.0:
            raise ValueError(f"DecoderConfig {self.name!r}: norm_eps must be > 0, got {self.norm_eps}")
        if self.rope_theta <= 0.0:
            raise ValueError(f"DecoderConfig {self.name!r}: rope_theta must be > 0, got {self.rope_theta}")

    def _check_choice(self, field_name: str, value: str, choices: tuple[str, ...]) -> None:
        if value not in choices:
            raise ValueError(f"DecoderConfig {self.name!r}: {field_name} must be one of {choices}, got {value!r}")

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def kv_dim(self) -> int:
        """Width of the key (and value) projection output."""
        return self.kv_heads * self.head_dim

    def param_count(self) -> int:
        """Number of parameters of :class:`Decoder` built from this config (tied weights counted once).

        A fused ``qkv_proj`` (h -> 3h) holds exactly the weights and biases of separate q, k, v projections.
        """
        h, b = self.hidden, int(self.bias)
        norm = h * (2 if self.norm == "layernorm" and self.bias else 1)
        attn = 2 * (h * h + b * h) + 2 * (h * self.kv_dim + b * self.kv_dim)
        n_in = 2 if self.mlp == "swiglu" else 1
        mlp = n_in * (h * self.ffn_hidden + b * self.ffn_hidden) + self.ffn_hidden * h + b * h
        total = self.vocab_size * h + self.layers * (2 * norm + attn + mlp) + norm
        if self.position == "learned":
            total += self.max_seq * h
        if self.embed_norm:
            total += norm
        if not self.tied_embeddings:
            total += self.vocab_size * h
        return total


class RMSNorm(nn.Module):
    """Root-mean-square norm written out as pow/mean/rsqrt/mul (no fused kernel)."""

    def __init__(self, hidden: int, eps: float, *, device=None, dtype=None) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(hidden, device=device, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        variance = x.pow(2).mean(-1, keepdim=True)
        return x * torch.rsqrt(variance + self.eps) * self.weight


def make_norm(config: DecoderConfig, **factory) -> nn.Module:
    if config.norm == "rmsnorm":
        return RMSNorm(config.hidden, config.norm_eps, **factory)
    return nn.LayerNorm(config.hidden, eps=config.norm_eps, bias=config.bias, **factory)


def _maybe_dropout(p: float) -> nn.Module:
    # A p == 0 dropout would still leave an aten.dropout node in a training-mode export.
    return nn.Dropout(p) if p > 0.0 else nn.Identity()


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rotary_tables(seq: int, head_dim: int, theta: float, ref: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables of shape (seq, head_dim) built from arange (nothing cached per length)."""
    exponent = torch.arange(0, head_dim, 2, device=ref.device, dtype=torch.float32) / head_dim
    inv_freq = 1.0 / (theta**exponent)
    positions = torch.arange(seq, device=ref.device, dtype=torch.float32)
    freqs = positions[:, None] * inv_freq[None, :]
    angles = torch.cat((freqs, freqs), dim=-1)
    cos, sin = angles.cos(), angles.sin()
    if ref.dtype != torch.float32:
        cos, sin = cos.to(ref.dtype), sin.to(ref.dtype)
    return cos, sin


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return x * cos + rotate_half(x) * sin


def alibi_slopes(heads: int, device: torch.device) -> torch.Tensor:
    """Per-head ALiBi slopes (Press et al.), including BLOOM's rule for non-power-of-two head counts."""
    closest = 2 ** math.floor(math.log2(heads))
    base = 2.0 ** (-8.0 / closest)
    slopes = base ** torch.arange(1, closest + 1, device=device, dtype=torch.float32)
    if closest == heads:
        return slopes
    extra_base = 2.0 ** (-4.0 / closest)
    n_extra = heads - closest
    extra = extra_base ** torch.arange(1, 2 * n_extra, 2, device=device, dtype=torch.float32)
    return torch.cat((slopes, extra))


def alibi_causal_mask(seq: int, heads: int, ref: torch.Tensor) -> torch.Tensor:
    """Additive (heads, seq, seq) mask: slope * (j - i) on and below the diagonal, -inf above it."""
    positions = torch.arange(seq, device=ref.device, dtype=torch.float32)
    distance = positions[None, :] - positions[:, None]
    bias = alibi_slopes(heads, ref.device)[:, None, None] * distance[None, :, :]
    mask = bias.masked_fill((distance > 0)[None, :, :], float("-inf"))
    return mask if ref.dtype == torch.float32 else mask.to(ref.dtype)


class Attention(nn.Module):
    """Multi-head self-attention (grouped-query when ``kv_heads < heads``; fused or separate q, k, v projections)."""

    def __init__(self, config: DecoderConfig, **factory) -> None:
        super().__init__()
        h, kv, b = config.hidden, config.kv_dim, config.bias
        self.heads, self.kv_heads, self.head_dim = config.heads, config.kv_heads, config.head_dim
        self.dropout = config.dropout
        self.fused_qkv = config.fused_qkv
        if self.fused_qkv:
            self.qkv_proj = nn.Linear(h, 3 * h, bias=b, **factory)
        else:
            self.q_proj = nn.Linear(h, h, bias=b, **factory)
            self.k_proj = nn.Linear(h, kv, bias=b, **factory)
            self.v_proj = nn.Linear(h, kv, bias=b, **factory)
        self.o_proj = nn.Linear(h, h, bias=b, **factory)

    def _split_heads(self, x: torch.Tensor) -> torch.Tensor:
        # (B, S, n*D) -> (B, n, S, D); sizes come from the tensor so nothing is specialised.
        return x.view(x.shape[0], x.shape[1], -1, self.head_dim).transpose(1, 2)

    def _project_fused(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        # (B, S, 3*h) -> (B, S, n, 3, D), Megatron's per-head interleaved layout, then q, k, v as (B, n, S, D).
        qkv = self.qkv_proj(x).view(x.shape[0], x.shape[1], self.heads, 3, self.head_dim)
        q, k, v = qkv.unbind(3)
        return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)

    def _repeat_kv(self, x: torch.Tensor) -> torch.Tensor:
        groups = self.heads // self.kv_heads
        if groups == 1:
            return x
        b, n, s, d = x.shape
        return x.unsqueeze(2).expand(b, n, groups, s, d).reshape(b, n * groups, s, d)

    def forward(
        self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None, mask: torch.Tensor | None
    ) -> torch.Tensor:
        if self.fused_qkv:
            q, k, v = self._project_fused(x)
        else:
            q = self._split_heads(self.q_proj(x))
            k = self._split_heads(self.k_proj(x))
            v = self._split_heads(self.v_proj(x))
        if rope is not None:
            q, k = apply_rotary(q, *rope), apply_rotary(k, *rope)
        k, v = self._repeat_kv(k), self._repeat_kv(v)
        p = self.dropout if self.training else 0.0
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=p, is_causal=mask is None)
        out = out.transpose(1, 2).reshape(x.shape[0], x.shape[1], -1)
        return self.o_proj(out)


class MLP(nn.Module):
    """The feed-forward block: up projection, GELU / ReLU / SwiGLU, down projection."""

    def __init__(self, config: DecoderConfig, **factory) -> None:
        super().__init__()
        h, f, b = config.hidden, config.ffn_hidden, config.bias
        self.kind = config.mlp
        if self.kind == "swiglu":
            self.gate_proj = nn.Linear(h, f, bias=b, **factory)
        self.up_proj = nn.Linear(h, f, bias=b, **factory)
        self.down_proj = nn.Linear(f, h, bias=b, **factory)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kind == "swiglu":
            hidden = F.silu(self.gate_proj(x)) * self.up_proj(x)
        elif self.kind == "relu":
            hidden = F.relu(self.up_proj(x))
        else:
            hidden = F.gelu(self.up_proj(x), approximate="tanh")
        return self.down_proj(hidden)


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, config: DecoderConfig, **factory) -> None:
        super().__init__()
        self.attn_norm = make_norm(config, **factory)
        self.attn = Attention(config, **factory)
        self.attn_dropout = _maybe_dropout(config.dropout)
        self.mlp_norm = make_norm(config, **factory)
        self.mlp = MLP(config, **factory)
        self.mlp_dropout = _maybe_dropout(config.dropout)

    def forward(
        self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None, mask: torch.Tensor | None
    ) -> torch.Tensor:
        x = x + self.attn_dropout(self.attn(self.attn_norm(x), rope, mask))
        return x + self.mlp_dropout(self.mlp(self.mlp_norm(x)))


def next_token_loss(logits: torch.Tensor, labels: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    """Mean cross-entropy of ``logits[:, :-1]`` against ``labels[:, 1:]``, computed without slicing to S - 1.

    Any strided tensor of length S - 1 makes export guard ``S - 1 != 1`` (a contiguity
    check), which a ``Dim("seq")`` starting below 3 rejects.  Shifting the labels with
    ``roll`` and masking the wrapped-around last column with ``ignore_index`` gives the
    same value, since ``cross_entropy`` averages over the non-ignored targets only.
    """
    seq = labels.shape[1]
    last = torch.arange(seq, device=labels.device) == seq - 1
    targets = torch.roll(labels, -1, dims=1).masked_fill(last, ignore_index)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=ignore_index)


class Decoder(nn.Module):
    """Decoder-only LM. ``forward(input_ids, labels=None)`` returns the mean next-token loss or the logits.

    Modules are created on the meta device first; unless the target device is
    ``meta`` they are then materialised with ``to_empty`` and initialised once
    (GPT-2 style: N(0, 0.02), residual projections scaled by 1/sqrt(2 * layers))
    from a private generator seeded with ``seed``, so construction is
    deterministic and never touches the global RNG.
    """

    def __init__(
        self,
        config: DecoderConfig,
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        seed: int = 0,
    ) -> None:
        super().__init__()
        self.config = config
        target = torch.device(device) if device is not None else torch.get_default_device()
        with torch.device("meta"):
            self._create_modules(dtype)
        if target.type != "meta":
            self.to_empty(device=target)
            self._tie_weights()
            self.init_weights(seed)
        logger.debug("built %s: %d parameters on %s", config.name, config.param_count(), target)

    def _create_modules(self, dtype: torch.dtype | None) -> None:
        config = self.config
        factory = {"dtype": dtype}
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden, **factory)
        if config.position == "learned":
            self.embed_positions = nn.Embedding(config.max_seq, config.hidden, **factory)
        if config.embed_norm:
            self.embed_norm = make_norm(config, **factory)
        self.embed_dropout = _maybe_dropout(config.dropout)
        self.blocks = nn.ModuleList(Block(config, **factory) for _ in range(config.layers))
        self.final_norm = make_norm(config, **factory)
        self.lm_head = nn.Linear(config.hidden, config.vocab_size, bias=False, **factory)
        self._tie_weights()

    def _tie_weights(self) -> None:
        if self.config.tied_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    @torch.no_grad()
    def init_weights(self, seed: int = 0) -> None:
        """(Re)initialise every parameter deterministically from ``seed``."""
        gen = torch.Generator(device=self.embed_tokens.weight.device).manual_seed(seed)
        residual_std = 0.02 / math.sqrt(2 * self.config.layers)
        for name, module in self.named_modules():
            if isinstance(module, nn.Linear):
                std = residual_std if name.endswith(("o_proj", "down_proj")) else 0.02
                if not (self.config.tied_embeddings and module is self.lm_head):
                    nn.init.normal_(module.weight, 0.0, std, generator=gen)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, nn.Embedding):
                nn.init.normal_(module.weight, 0.0, 0.02, generator=gen)
            elif isinstance(module, (nn.LayerNorm, RMSNorm)):
                nn.init.ones_(module.weight)
                if getattr(module, "bias", None) is not None:
                    nn.init.zeros_(module.bias)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        config = self.config
        seq = input_ids.shape[1]
        x = self.embed_tokens(input_ids)
        if config.position == "learned":
            x = x + self.embed_positions(torch.arange(seq, device=input_ids.device))
        if config.embed_norm:
            x = self.embed_norm(x)
        x = self.embed_dropout(x)
        rope = rotary_tables(seq, config.head_dim, config.rope_theta, x) if config.position == "rotary" else None
        mask = alibi_causal_mask(seq, config.heads, x) if config.position == "alibi" else None
        for block in self.blocks:
            x = block(x, rope, mask)
        logits = self.lm_head(self.final_norm(x))
        if labels is None:
            return logits
        return next_token_loss(logits, labels)
