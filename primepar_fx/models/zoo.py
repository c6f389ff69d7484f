"""Named :class:`DecoderConfig` presets: the paper's evaluation models plus tiny test-sized variants.

GPT-2 and BLOOM compute Q, K and V with one fused projection (``fused_qkv=True``, Megatron's per-head layout);
Llama and OPT keep separate q, k, v projections.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from primepar_fx.models.reference import Decoder, DecoderConfig

_GPT2 = DecoderConfig(
    name="gpt2",
    vocab_size=50257,
    hidden=768,
    layers=12,
    heads=12,
    ffn_hidden=3072,
    fused_qkv=True,
    norm="layernorm",
    mlp="gelu",
    position="learned",
    bias=True,
    tied_embeddings=True,
    max_seq=1024,
    description="GPT-2 small (124M): fused QKV, LayerNorm, GELU, learned positions, biases, tied embeddings",
)

_LLAMA2_7B = DecoderConfig(
    name="llama2-7b",
    vocab_size=32000,
    hidden=4096,
    layers=32,
    heads=32,
    ffn_hidden=11008,
    norm="rmsnorm",
    mlp="swiglu",
    position="rotary",
    bias=False,
    tied_embeddings=False,
    max_seq=4096,
    norm_eps=1e-5,
    description="Llama-2 7B: RMSNorm, SwiGLU, rotary positions, no biases, untied embeddings",
)

_OPT_6_7B = DecoderConfig(
    name="opt-6.7b",
    vocab_size=50272,
    hidden=4096,
    layers=32,
    heads=32,
    ffn_hidden=16384,
    norm="layernorm",
    mlp="relu",
    position="learned",
    bias=True,
    tied_embeddings=True,
    max_seq=2048,
    description="OPT 6.7B: LayerNorm, ReLU, learned positions, biases, tied embeddings",
)

_BLOOM_7B1 = DecoderConfig(
    name="bloom-7b1",
    vocab_size=250880,
    hidden=4096,
    layers=30,
    heads=32,
    ffn_hidden=16384,
    fused_qkv=True,
    norm="layernorm",
    mlp="gelu",
    position="alibi",
    bias=True,
    tied_embeddings=True,
    max_seq=2048,
    embed_norm=True,
    description="BLOOM 7.1B: fused QKV, LayerNorm, GELU, ALiBi, biases, tied embeddings, embedding LayerNorm",
)

# replace() copies the resolved kv_heads, so presets that change `heads` pass kv_heads explicitly.
_TINY = {"vocab_size": 256, "hidden": 64, "layers": 2, "heads": 4, "max_seq": 128}

_CONFIGS = (
    _GPT2,
    replace(
        _GPT2,
        name="gpt2-tiny",
        kv_heads=None,
        ffn_hidden=256,
        description="GPT-2 style, tiny (2 layers, hidden 64)",
        **_TINY,
    ),
    _LLAMA2_7B,
    replace(
        _LLAMA2_7B,
        name="llama2-70b",
        hidden=8192,
        layers=80,
        heads=64,
        kv_heads=8,
        ffn_hidden=28672,
        description="Llama-2 70B: Llama-2 style with grouped-query attention (64 query / 8 kv heads)",
    ),
    replace(
        _LLAMA2_7B,
        name="llama-tiny",
        kv_heads=2,
        ffn_hidden=176,
        description="Llama style with GQA (4 query / 2 kv heads), tiny (2 layers, hidden 64)",
        **_TINY,
    ),
    _OPT_6_7B,
    replace(
        _OPT_6_7B,
        name="opt-175b",
        hidden=12288,
        layers=96,
        heads=96,
        kv_heads=None,
        ffn_hidden=49152,
        description="OPT 175B: OPT style at GPT-3 scale",
    ),
    replace(
        _OPT_6_7B,
        name="opt-tiny",
        kv_heads=None,
        ffn_hidden=256,
        description="OPT style, tiny (2 layers, hidden 64)",
        **_TINY,
    ),
    _BLOOM_7B1,
    replace(
        _BLOOM_7B1,
        name="bloom-176b",
        hidden=14336,
        layers=70,
        heads=112,
        kv_heads=None,
        ffn_hidden=57344,
        description="BLOOM 176B: BLOOM style, 112 heads (non-power-of-two ALiBi slopes)",
    ),
    replace(
        _BLOOM_7B1,
        name="bloom-tiny",
        kv_heads=None,
        ffn_hidden=256,
        description="BLOOM style, tiny (2 layers, hidden 64)",
        **_TINY,
    ),
)

ZOO: dict[str, DecoderConfig] = {config.name: config for config in _CONFIGS}


def get_config(name: str) -> DecoderConfig:
    """Return the zoo config called ``name``; raises ValueError listing the known names otherwise."""
    try:
        return ZOO[name]
    except KeyError:
        raise ValueError(f"unknown model {name!r}; available zoo models: {', '.join(sorted(ZOO))}") from None


def build(
    name_or_config: str | DecoderConfig,
    *,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
    seed: int = 0,
) -> Decoder:
    """Build a :class:`Decoder` from a zoo name or a config.

    ``device="meta"`` gives a weightless model in well under a second even for
    llama2-70b / bloom-176b; any other device gets deterministic weights from ``seed``.
    """
    if isinstance(name_or_config, DecoderConfig):
        config = name_or_config
    elif isinstance(name_or_config, str):
        config = get_config(name_or_config)
    else:
        raise ValueError(f"build() expects a zoo name or a DecoderConfig, got {type(name_or_config).__name__}")
    return Decoder(config, device=device, dtype=dtype, seed=seed)


def example_inputs(
    config: DecoderConfig,
    batch: int,
    seq: int,
    *,
    device: torch.device | str | None = None,
    seed: int = 0,
) -> tuple[tuple[torch.Tensor], dict[str, torch.Tensor]]:
    """``((input_ids,), {"labels": input_ids})`` of shape (batch, seq), drawn from a seeded generator."""
    if batch < 1 or seq < 1:
        raise ValueError(f"batch and seq must be >= 1, got batch={batch}, seq={seq}")
    if seq > config.max_seq:
        raise ValueError(f"seq={seq} exceeds {config.name!r}'s max_seq={config.max_seq}")
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, config.vocab_size, (batch, seq), generator=gen)
    if device is not None:
        ids = ids.to(device)
    return (ids,), {"labels": ids}


def dynamic_shapes(max_seq: int, names: tuple[str, ...] = ("input_ids", "labels")) -> dict[str, dict[int, object]]:
    """``dynamic_shapes`` for ``torch.export.export``: dim 0 is ``Dim("batch")``, dim 1 ``Dim("seq", max=max_seq)``.

    Keyed by argument name, so it serves both ``Decoder`` (positional ``input_ids``)
    and Hugging Face models (keyword ``input_ids``/``labels``).
    """
    batch = torch.export.Dim("batch")
    seq = torch.export.Dim("seq", max=max_seq)
    return {name: {0: batch, 1: seq} for name in names}
