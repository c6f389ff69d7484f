"""Tiny Hugging Face ``transformers`` models for tests, and model-spec resolution for command lines.

``transformers`` is an optional dependency (``pip install primepar-fx[hf]``) and is
imported lazily inside :func:`build_hf_tiny`; nothing here touches the network.
"""

from __future__ import annotations

import importlib
import logging
import os
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from primepar_fx.utils.configs import unset_note

logger = logging.getLogger(__name__)

HF_FAMILIES = ("gpt2", "llama", "opt", "bloom", "falcon")

TINY_VOCAB = 128
TINY_HIDDEN = 64
TINY_LAYERS = 2
TINY_HEADS = 4
TINY_MAX_POSITIONS = 64
_SPECIAL_TOKENS = {"bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 2}


def _import_transformers() -> Any:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        import transformers
    except ImportError as exc:
        raise ImportError(
            "Hugging Face models need the optional 'transformers' dependency; "
            "install it with `pip install primepar-fx[hf]`"
        ) from exc
    return transformers


def _tiny_config(transformers: Any, family: str, layers: int) -> Any:
    common = {"vocab_size": TINY_VOCAB, "use_cache": False, **_SPECIAL_TOKENS}
    if family == "gpt2":
        return transformers.GPT2Config(
            n_embd=TINY_HIDDEN, n_layer=layers, n_head=TINY_HEADS, n_inner=4 * TINY_HIDDEN,
            n_positions=TINY_MAX_POSITIONS, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, **common,
        )  # fmt: skip
    if family == "llama":
        return transformers.LlamaConfig(
            hidden_size=TINY_HIDDEN, num_hidden_layers=layers, num_attention_heads=TINY_HEADS,
            num_key_value_heads=TINY_HEADS // 2, intermediate_size=2 * TINY_HIDDEN,
            max_position_embeddings=TINY_MAX_POSITIONS, attention_dropout=0.0, **common,
        )  # fmt: skip
    if family == "opt":
        return transformers.OPTConfig(
            hidden_size=TINY_HIDDEN, num_hidden_layers=layers, num_attention_heads=TINY_HEADS,
            ffn_dim=4 * TINY_HIDDEN, word_embed_proj_dim=TINY_HIDDEN, max_position_embeddings=TINY_MAX_POSITIONS,
            dropout=0.0, attention_dropout=0.0, layerdrop=0.0, **common,
        )  # fmt: skip
    if family == "falcon":  # the 7B layout: parallel attention and MLP, one shared key/value head, rotary
        return transformers.FalconConfig(
            hidden_size=TINY_HIDDEN, num_hidden_layers=layers, num_attention_heads=TINY_HEADS,
            max_position_embeddings=TINY_MAX_POSITIONS, new_decoder_architecture=False, multi_query=True,
            parallel_attn=True, hidden_dropout=0.0, attention_dropout=0.0, **common,
        )  # fmt: skip
    return transformers.BloomConfig(
        hidden_size=TINY_HIDDEN, n_layer=layers, n_head=TINY_HEADS, hidden_dropout=0.0, attention_dropout=0.0,
        attn_implementation="eager", **common,
    )  # fmt: skip


_MODEL_CLASSES = {
    "gpt2": "GPT2LMHeadModel",
    "llama": "LlamaForCausalLM",
    "opt": "OPTForCausalLM",
    "bloom": "BloomForCausalLM",
    "falcon": "FalconForCausalLM",
}


#: what a tiny config of any other family sets (transformers' common names; a family maps them to its own)
TINY_GENERIC = {
    "hidden_size": TINY_HIDDEN,
    "num_attention_heads": TINY_HEADS,
    "num_key_value_heads": TINY_HEADS // 2,
    "head_dim": TINY_HIDDEN // TINY_HEADS,
    "intermediate_size": 2 * TINY_HIDDEN,
    "max_position_embeddings": TINY_MAX_POSITIONS,
    "rotary_dim": TINY_HIDDEN // TINY_HEADS,  # GPT-J, CodeGen: rotary on the whole head
    "tie_word_embeddings": False,
}
#: on top of :data:`TINY_GENERIC`, for families with DeepSeek's multi-head latent attention (their configs have a
#: ``kv_lora_rank``: DeepSeek-V2/V3, MiniCPM3, ...): the rotary and no-rotary parts of a query/key head, the value
#: head, the low-rank latents, as many key/value heads as query heads; a dense first layer and one shared expert
TINY_LATENT = {
    "head_dim": 8,
    "rotary_dim": 8,
    "num_key_value_heads": TINY_HEADS,
    "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 8,
    "v_head_dim": 16,
    "kv_lora_rank": 32,
    "q_lora_rank": 48,
    "first_k_dense_replace": 1,
    "n_shared_experts": 1,
}
#: on top of :data:`TINY_GENERIC`, for mixture-of-experts families (those of the names a family's config has): 4
#: experts (2 a token), each as wide as the hidden, so a plan may split them over 2 or 4 ranks
TINY_MOE = {
    "num_local_experts": 4,
    "num_experts": 4,
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": TINY_HIDDEN,
    "shared_expert_intermediate_size": 2 * TINY_HIDDEN,
    "n_group": 1,
    "topk_group": 1,
    "num_dense_layers": 1,  # LFM2-MoE, AFMoE: dense layers before the first mixture-of-experts one
}
#: for mixture-of-experts families whose config leaves these unset (``None``) by default though their model needs
#: them (dots.llm1's shared experts)
TINY_MOE_UNSET = {"n_shared_experts": 1}


#: families that train on 2 ranks equal to one device from their tiny config (docs/coverage.md, bench/coverage.py);
#: CI checks a rotating pair of them (tests/compiler/test_distributed.py)
COVERED_FAMILIES = (
    *HF_FAMILIES, "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text", "phi", "phi3", "stablelm",
    "starcoder2", "olmo", "olmo2", "gpt_neox", "gptj", "codegen", "cohere", "glm", "granite", "helium", "nemotron",
    "xglm", "biogpt", "persimmon", "arcee", "smollm3", "gpt_neo", "mpt", "mixtral", "qwen2_moe", "olmoe", "qwen3_moe",
    "granitemoe", "granitemoeshared", "hunyuan_v1_moe", "flex_olmo", "minimax", "cohere2_moe", "ernie4_5_moe",
    "glm4_moe", "exaone_moe", "afmoe", "deepseek_v3", "deepseek_v2", "gpt_oss", "apertus", "cohere2", "diffllama",
    "doge", "exaone", "exaone4", "ernie4_5", "glm4", "gpt_bigcode", "granite_swa", "hunyuan_v1_dense", "internlm3",
    "lfm2", "llama4_text", "ministral", "ministral3", "nanochat", "olmo3", "seed_oss", "bitnet", "openai-gpt",
    "vaultgemma", "solar_open", "cwm", "mellum", "jais2", "minicpm3", "youtu", "minimax_m2", "sarvam_moe",
    "glm4_moe_lite", "deepseek_v32", "longcat_flash", "dots1", "lfm2_moe",
)  # fmt: skip


def hf_families() -> list[str]:
    """Every ``model_type`` transformers can build a tiny causal LM of (:func:`build_hf_tiny`), the curated
    :data:`HF_FAMILIES` first."""
    transformers = _import_transformers()
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return [*HF_FAMILIES, *sorted(set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES) - set(HF_FAMILIES))] if transformers else []


def build_hf_tiny(family: str, *, seed: int = 0, layers: int = TINY_LAYERS) -> nn.Module:
    """A randomly initialised tiny causal LM of ``family``: one of :data:`HF_FAMILIES` (configs written out
    here), or any other ``model_type`` transformers has a causal LM for (its config's defaults with
    :data:`TINY_GENERIC` on top; a family whose own names differ may need a config file instead, see
    :func:`from_config`).

    Hidden 64, ``layers`` layers (default 2), 4 heads, vocab 128, at most 64 positions, ``use_cache=False``,
    in ``train()`` mode with every dropout probability at 0.0 so runs are deterministic.
    Weights come from ``seed`` without disturbing the caller's global RNG state.
    """
    transformers = _import_transformers()
    if family in HF_FAMILIES:
        config = _tiny_config(transformers, family, layers)
        model_cls = getattr(transformers, _MODEL_CLASSES[family])
        build = model_cls
    else:
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

        if family not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
            raise ValueError(
                f"unknown Hugging Face family {family!r}; choose one of {HF_FAMILIES}, or any model_type with a "
                "causal LM in transformers (primepar_fx.models.hf_families() lists them)"
            )
        common = {"vocab_size": TINY_VOCAB, "use_cache": False, "num_hidden_layers": layers, **_SPECIAL_TOKENS}
        if family == "gpt_neo":  # one attention type per layer, listed: every layer global
            common["attention_types"] = [[["global"], layers]]
        latent = hasattr(transformers.AutoConfig.for_model(family), "kv_lora_rank")
        tiny = {**TINY_GENERIC, **(TINY_LATENT if latent else {})}
        config = transformers.AutoConfig.for_model(family, **tiny, **common)
        for name, value in TINY_MOE.items():
            if hasattr(config, name):
                setattr(config, name, value)
        for name, value in TINY_MOE_UNSET.items():
            if hasattr(config, name) and getattr(config, name) is None:
                setattr(config, name, value)
        if hasattr(config, "layer_types") and config.layer_types is None:  # left unset (LFM2-MoE): all attention
            config.layer_types = ["full_attention"] * layers
        for name, value in list(vars(config).items()):  # every dropout (functional ones too) and layer drop off
            if isinstance(value, float) and any(k in name for k in ("dropout", "pdrop", "layerdrop")):
                setattr(config, name, 0.0)
        build = transformers.AutoModelForCausalLM.from_config
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = build(config)
    for module in model.modules():
        if isinstance(module, nn.Dropout):
            module.p = 0.0
    model.train()
    logger.debug("built tiny %s (%d parameters)", type(model).__name__, sum(p.numel() for p in model.parameters()))
    return model


def from_config(
    config: str | os.PathLike[str] | dict[str, Any], *, layers: int | None = None, device: str | torch.device = "meta"
) -> nn.Module:
    """The causal LM of a Hugging Face ``config.json`` (a path, or its parsed dict), built offline with random
    weights (on the meta device by default: shapes only, nothing allocated), ``use_cache=False``, in ``train()``.

    ``layers``: keep only the first ``layers`` decoder layers (a quick look at a large model; per-layer lists such
    as ``layer_types`` are cut to match). Every checkpoint on the Hub ships such a file; ``model_type`` says which
    ``transformers`` class to build. Raises ``ValueError`` naming the file and the field that is wrong.
    """
    import json

    where = "config" if isinstance(config, dict) else str(config)
    if isinstance(config, dict):
        data = dict(config)
    else:
        try:
            with open(config, encoding="utf-8") as f:
                data = json.load(f)
        except OSError as exc:
            raise ValueError(f"cannot read Hugging Face config {where}: {exc.strerror or exc}") from None
        except json.JSONDecodeError as exc:
            raise ValueError(f"{where} is not JSON: {exc}") from None
    if not isinstance(data, dict) or not isinstance(data.get("model_type"), str):
        raise ValueError(f"{where}: a Hugging Face config needs a 'model_type' (e.g. \"llama\"), and has none")
    transformers = _import_transformers()
    model_type = data.pop("model_type")
    try:
        hf_config = transformers.AutoConfig.for_model(model_type, **data)
    except ValueError as exc:
        raise ValueError(f"{where}: model_type {model_type!r} is not one transformers knows ({exc})") from None
    except Exception as exc:  # a field of the wrong type (transformers' strict config dataclasses)
        raise ValueError(f"{where}: transformers rejects it as a {model_type} config ({_first_line(exc)})") from exc
    if layers is not None:
        depth = getattr(hf_config, "num_hidden_layers", None)
        if isinstance(layers, bool) or not isinstance(layers, int) or layers < 1:
            raise ValueError(f"layers must be an integer >= 1, got {layers!r}")
        if depth is None:
            raise ValueError(f"{where}: {model_type} configs have no num_hidden_layers to cut to {layers}")
        hf_config.num_hidden_layers = min(layers, depth)
        for name in ("layer_types", "mlp_only_layers"):
            value = getattr(hf_config, name, None)
            if isinstance(value, list) and len(value) == depth:
                setattr(hf_config, name, value[: hf_config.num_hidden_layers])
    hf_config.use_cache = False
    try:
        with torch.device(device), torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            model = transformers.AutoModelForCausalLM.from_config(hf_config)
    except ValueError as exc:
        raise ValueError(f"{where}: transformers has no causal LM for model_type {model_type!r} ({exc})") from None
    except Exception as exc:  # the model's constructor failed on this config: say which fields it may lack
        raise ValueError(
            f"{where}: transformers could not build its {model_type} model ({_first_line(exc)}){unset_note(hf_config)}"
        ) from exc
    model.train()
    logger.debug("built %s from %s (%d layers)", type(model).__name__, where, hf_config.num_hidden_layers)
    return model


def _first_line(exc: BaseException) -> str:
    """``Type: first line of the message`` (transformers' validation errors run to several lines)."""
    lines = [line.strip() for line in str(exc).strip().splitlines() if line.strip()]
    return f"{type(exc).__name__}: {' '.join(lines[:2])[:300]}"


def is_config_file(spec: str) -> bool:
    """Whether a MODEL argument names a Hugging Face config file: ``path/to/config.json`` or ``hf:path/...json``."""
    path = spec[3:] if spec.startswith("hf:") else spec
    return path.endswith(".json")


def hf_example_inputs(
    model: nn.Module, batch: int, seq: int, *, seed: int = 0
) -> tuple[tuple[()], dict[str, torch.Tensor]]:
    """``((), {"input_ids": ids, "labels": ids})`` with token ids drawn from a seeded generator."""
    if batch < 1 or seq < 1:
        raise ValueError(f"batch and seq must be >= 1, got batch={batch}, seq={seq}")
    config = model.config
    limit = getattr(config, "max_position_embeddings", None)
    if limit is not None and seq > limit:
        raise ValueError(f"seq={seq} exceeds the model's max_position_embeddings={limit}")
    device = next(model.parameters()).device
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, config.vocab_size, (batch, seq), generator=gen).to(device)
    return (), {"input_ids": ids, "labels": ids}


def _resolve_callable(spec: str) -> Callable[..., Any]:
    module_name, _, attr_path = spec.partition(":")
    if not module_name or not attr_path:
        raise ValueError(f"model spec {spec!r} must look like 'package.module:callable'")
    try:
        target: Any = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"model spec {spec!r}: cannot import module {module_name!r} ({exc})") from exc
    for part in attr_path.split("."):
        try:
            target = getattr(target, part)
        except AttributeError:
            raise ValueError(f"model spec {spec!r}: {module_name!r} has no attribute {attr_path!r}") from None
    if not callable(target):
        raise ValueError(f"model spec {spec!r}: {attr_path!r} is a {type(target).__name__}, not a callable")
    return target


def load_model_spec(spec: str, **kwargs: Any) -> nn.Module | tuple[nn.Module, tuple, dict]:
    """Resolve ``spec`` to a model.

    ``spec`` is either a zoo name (``"gpt2"``, ``"llama2-70b"`` ...; ``kwargs`` go to
    :func:`primepar_fx.models.build`, e.g. ``device="meta"``) or ``"package.module:callable"``,
    which is imported and called with ``kwargs``; such a callable may also return
    ``(module, example_args, example_kwargs)``, which is passed through.
    """
    from primepar_fx.models.zoo import ZOO, build

    if not isinstance(spec, str) or not spec:
        raise ValueError(f"model spec must be a non-empty string, got {spec!r}")
    if spec in ZOO:
        return build(spec, **kwargs)
    if ":" not in spec:
        raise ValueError(
            f"unknown model {spec!r}: expected a zoo name ({', '.join(sorted(ZOO))}) "
            "or an importable 'package.module:callable'"
        )
    model = _resolve_callable(spec)(**kwargs)
    if isinstance(model, tuple) and len(model) == 3 and isinstance(model[0], nn.Module):
        return model  # (module, example_args, example_kwargs)
    if not isinstance(model, nn.Module):
        raise ValueError(f"model spec {spec!r} returned a {type(model).__name__}, expected a torch.nn.Module")
    return model
