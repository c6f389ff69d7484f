"""Tests for primepar_fx.models: reference decoders, the zoo, tiny Hugging Face models, and dynamic export."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from primepar_fx.models import (
    HF_FAMILIES,
    ZOO,
    Decoder,
    DecoderConfig,
    build,
    build_hf_tiny,
    dynamic_shapes,
    example_inputs,
    get_config,
    hf_example_inputs,
    load_model_spec,
)

TINY = ("gpt2-tiny", "llama-tiny", "opt-tiny", "bloom-tiny")
HF_MAX_SEQ = 64


def _hf_available() -> bool:
    try:
        import transformers  # noqa: F401
    except ImportError:
        return False
    return True


needs_hf = pytest.mark.skipif(not _hf_available(), reason="transformers not installed (pip install primepar-fx[hf])")


def _free_symbols(size: object) -> set:
    return set(size.node.expr.free_symbols) if isinstance(size, torch.SymInt) else set()


def _iter_vals(val: object):
    if isinstance(val, (list, tuple)):
        for item in val:
            yield from _iter_vals(item)
    elif val is not None:
        yield val


def assert_shapes_use_only_input_symbols(ep: torch.export.ExportedProgram) -> None:
    """Batch and seq stay symbolic, and every shape in the graph is an expression in those two symbols."""
    nodes = {node.name: node for node in ep.graph.nodes}
    ids_shape = nodes["input_ids"].meta["val"].shape
    labels_shape = nodes["labels"].meta["val"].shape
    assert all(isinstance(size, torch.SymInt) for size in ids_shape), f"input_ids specialised: {ids_shape}"
    batch, seq = (size.node.expr for size in ids_shape)
    assert batch != seq, "batch and seq were unified into one symbol"
    assert [size.node.expr for size in labels_shape] == [batch, seq]
    allowed = {batch, seq}
    for node in ep.graph.nodes:
        for val in _iter_vals(node.meta.get("val")):
            sizes = val.shape if isinstance(val, torch.Tensor) else [val]
            for size in sizes:
                extra = _free_symbols(size) - allowed
                assert not extra, f"{node.format_node()} has shape {sizes} with foreign symbols {extra}"


def _loss_of(out: object) -> torch.Tensor:
    return out if isinstance(out, torch.Tensor) else out["loss"]


# --- configs and the zoo ---------------------------------------------------------------------------------


def test_zoo_holds_every_required_model_with_a_description():
    required = {"gpt2", "gpt2-tiny", "llama2-7b", "llama2-70b", "opt-6.7b", "opt-175b", "bloom-7b1", "bloom-176b"}
    assert required | set(TINY) <= set(ZOO)
    for name, config in ZOO.items():
        assert config.name == name
        assert config.description and "\n" not in config.description


def test_config_defaults_kv_heads_to_heads_and_is_frozen():
    config = get_config("gpt2-tiny")
    assert config.kv_heads == config.heads == 4
    with pytest.raises(AttributeError):
        config.hidden = 1  # type: ignore[misc]
    assert get_config("llama2-70b").kv_heads == 8


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"hidden": 65}, "divisible by heads"),
        ({"kv_heads": 3}, "divisible by kv_heads"),
        ({"norm": "batchnorm"}, "norm must be one of"),
        ({"mlp": "tanh"}, "mlp must be one of"),
        ({"position": "sinusoid"}, "position must be one of"),
        ({"layers": 0}, "layers must be a positive int"),
        ({"dropout": 1.0}, "dropout must be in"),
    ],
)
def test_invalid_configs_are_rejected_with_a_clear_message(overrides, message):
    with pytest.raises(ValueError, match=message):
        replace(get_config("gpt2-tiny"), **overrides)


def test_unknown_zoo_name_lists_available_models():
    with pytest.raises(ValueError, match="llama2-70b"):
        get_config("gpt5")


@pytest.mark.parametrize("name", TINY)
def test_param_count_matches_the_built_tiny_model(name):
    model = build(name)
    assert model.config.param_count() == sum(p.numel() for p in model.parameters())


def test_gpt2_param_count_is_124m_on_meta_device():
    model = build("gpt2", device="meta")
    counted = sum(p.numel() for p in model.parameters())
    assert counted == ZOO["gpt2"].param_count()
    assert 124e6 < counted < 125e6


@pytest.mark.parametrize(("name", "billions"), [("llama2-70b", 69.0), ("bloom-176b", 176.2)])
def test_llama2_70b_and_bloom_176b_build_on_meta_device(name, billions):
    model = build(name, device="meta")
    params = list(model.parameters())
    assert all(p.is_meta for p in params)
    assert sum(p.numel() for p in params) == model.config.param_count()
    assert model.config.param_count() / 1e9 == pytest.approx(billions, rel=0.01)


def test_tied_embeddings_share_one_parameter_and_untied_do_not():
    gpt2 = build("gpt2-tiny")
    assert gpt2.lm_head.weight is gpt2.embed_tokens.weight
    llama = build("llama-tiny")
    assert llama.lm_head.weight is not llama.embed_tokens.weight


def test_build_honours_dtype_and_seed():
    model = build("gpt2-tiny", dtype=torch.bfloat16)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    same = build("gpt2-tiny", seed=0).embed_tokens.weight
    assert torch.equal(build("gpt2-tiny", seed=0).embed_tokens.weight, same)
    assert not torch.equal(build("gpt2-tiny", seed=1).embed_tokens.weight, same)


# --- reference models: eager -----------------------------------------------------------------------------


@pytest.mark.parametrize("name", TINY)
def test_every_tiny_config_runs_forward_and_backward(name):
    model = build(name).train()
    args, kwargs = example_inputs(model.config, batch=2, seq=16)
    logits = model(*args)
    assert logits.shape == (2, 16, model.config.vocab_size)
    loss = model(*args, **kwargs)
    assert loss.ndim == 0 and torch.isfinite(loss)
    loss.backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())


@pytest.mark.parametrize("name", TINY)
def test_loss_equals_cross_entropy_of_shifted_logits(name):
    model = build(name)
    (ids,), kwargs = example_inputs(model.config, batch=3, seq=9, seed=5)
    logits = model(ids)
    expected = F.cross_entropy(logits[:, :-1].reshape(-1, model.config.vocab_size), ids[:, 1:].reshape(-1))
    torch.testing.assert_close(model(ids, **kwargs), expected)


@pytest.mark.parametrize("name", TINY)
def test_tiny_models_are_causal(name):
    model = build(name)
    (ids,), _ = example_inputs(model.config, batch=1, seq=12)
    changed = ids.clone()
    changed[0, -1] = (changed[0, -1] + 1) % model.config.vocab_size
    torch.testing.assert_close(model(ids)[:, :-1], model(changed)[:, :-1])


def test_gpt2_tiny_initial_loss_is_close_to_log_vocab():
    model = build("gpt2-tiny")
    args, kwargs = example_inputs(model.config, batch=2, seq=32)
    loss = model(*args, **kwargs)
    assert torch.isfinite(loss)
    assert loss.item() == pytest.approx(math.log(model.config.vocab_size), abs=0.25)


def test_example_inputs_are_seeded_and_validated():
    config = get_config("gpt2-tiny")
    (a,), kwargs = example_inputs(config, 2, 16)
    (b,), _ = example_inputs(config, 2, 16)
    assert torch.equal(a, b) and kwargs["labels"] is a and a.shape == (2, 16)
    with pytest.raises(ValueError, match="max_seq"):
        example_inputs(config, 1, config.max_seq + 1)


# --- reference models: export ----------------------------------------------------------------------------


@pytest.mark.parametrize("name", TINY)
def test_tiny_zoo_configs_export_with_dynamic_batch_and_seq(name):
    model = build(name).train()
    args, kwargs = example_inputs(model.config, batch=2, seq=16)
    ep = torch.export.export(model, args, kwargs, dynamic_shapes=dynamic_shapes(model.config.max_seq))
    assert_shapes_use_only_input_symbols(ep)
    (ids,), other = example_inputs(model.config, batch=3, seq=7, seed=1)
    torch.testing.assert_close(ep.module()(ids, **other), model(ids, **other))


# --- Hugging Face tiny models ----------------------------------------------------------------------------


@needs_hf
@pytest.mark.parametrize("family", HF_FAMILIES)
def test_every_hf_tiny_model_runs_forward_and_backward_deterministically(family):
    model = build_hf_tiny(family)
    assert model.training and model.config.vocab_size == 128
    args, kwargs = hf_example_inputs(model, batch=2, seq=16)
    loss = model(*args, **kwargs).loss
    assert torch.isfinite(loss)
    assert loss.item() == pytest.approx(math.log(128), abs=0.5)
    loss.backward()
    assert loss.item() == build_hf_tiny(family)(*args, **kwargs).loss.item()


@needs_hf
@pytest.mark.parametrize("family", HF_FAMILIES)
def test_hf_tiny_models_export_with_dynamic_batch_and_seq(family):
    model = build_hf_tiny(family)
    args, kwargs = hf_example_inputs(model, batch=2, seq=16)
    ep = torch.export.export(model, args, kwargs, dynamic_shapes=dynamic_shapes(HF_MAX_SEQ))
    assert_shapes_use_only_input_symbols(ep)
    _, other = hf_example_inputs(model, batch=3, seq=7, seed=1)
    torch.testing.assert_close(_loss_of(ep.module()(**other)), model(**other).loss)


def test_unknown_hf_family_is_rejected():
    with pytest.raises(ValueError, match="gpt2"):
        build_hf_tiny("t5")  # an encoder-decoder: no causal LM


def test_any_causal_lm_family_gets_a_tiny_config():
    from primepar_fx.models import hf_families

    families = hf_families()
    assert families[: len(HF_FAMILIES)] == list(HF_FAMILIES) and "mistral" in families and "t5" not in families
    model = build_hf_tiny("mistral", layers=3)
    config = model.config
    assert type(model).__name__ == "MistralForCausalLM" and config.num_hidden_layers == 3
    assert (config.hidden_size, config.num_attention_heads, config.vocab_size) == (64, 4, 128)
    assert config.use_cache is False and model.training


# --- model specs -----------------------------------------------------------------------------------------


def test_load_model_spec_resolves_zoo_names_and_import_paths():
    model = load_model_spec("llama2-7b", device="meta")
    assert isinstance(model, Decoder) and model.config is ZOO["llama2-7b"]
    model = load_model_spec("primepar_fx.models:build", name_or_config="opt-tiny")
    assert isinstance(model, Decoder) and model.config.name == "opt-tiny"


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("gpt5", "gpt2-tiny"),
        ("no_such_module_xyz:make", "cannot import module"),
        ("primepar_fx.models:nope", "has no attribute"),
        ("primepar_fx.models:ZOO", "not a callable"),
        ("primepar_fx.models:get_config", "expected a torch.nn.Module"),
    ],
)
def test_load_model_spec_errors_are_actionable(spec, message):
    kwargs = {"name": "gpt2"} if spec.endswith("get_config") else {}
    with pytest.raises(ValueError, match=message):
        load_model_spec(spec, **kwargs)


def test_decoder_config_is_exported_from_the_package():
    assert isinstance(ZOO["gpt2"], DecoderConfig)


# --- fused QKV -------------------------------------------------------------------------------------------

FUSED = {"gpt2", "gpt2-tiny", "bloom-7b1", "bloom-176b", "bloom-tiny"}


def test_gpt2_and_bloom_fuse_qkv_and_llama_and_opt_do_not():
    assert {name for name, config in ZOO.items() if config.fused_qkv} == FUSED
    for name in FUSED:
        attn = build(name, device="meta").blocks[0].attn
        assert attn.qkv_proj.out_features == 3 * ZOO[name].hidden
        assert not hasattr(attn, "q_proj")


def test_fused_qkv_needs_plain_multi_head_attention():
    with pytest.raises(ValueError, match="fused_qkv needs kv_heads == heads"):
        replace(get_config("llama-tiny"), fused_qkv=True)  # 4 query heads, 2 kv heads
    with pytest.raises(ValueError, match="fused_qkv must be a bool"):
        replace(get_config("gpt2-tiny"), fused_qkv=1)
    assert replace(get_config("llama-tiny"), kv_heads=4, fused_qkv=True).fused_qkv


@pytest.mark.parametrize("name", ["gpt2-tiny", "bloom-tiny"])
def test_fused_qkv_is_the_per_head_interleaved_layout_of_separate_projections(name):
    """qkv_proj's rows are (heads, 3, head_dim): loading q, k, v interleaved per head gives the same model."""
    fused = build(name)
    plain = build(replace(fused.config, fused_qkv=False), seed=3)
    assert fused.config.param_count() == plain.config.param_count() == sum(p.numel() for p in plain.parameters())
    heads, head_dim = fused.config.heads, fused.config.head_dim
    state = {}
    for key, value in plain.state_dict().items():
        module, _, kind = key.rpartition(".")
        if module.endswith(("k_proj", "v_proj")):
            continue
        if module.endswith("q_proj"):
            parts = [plain.state_dict()[f"{module[:-6]}{p}_proj.{kind}"] for p in "qkv"]
            rows = torch.stack([p.reshape(heads, head_dim, -1) for p in parts], dim=1)  # (heads, 3, head_dim, ...)
            key, value = f"{module[:-6]}qkv_proj.{kind}", rows.reshape(3 * fused.config.hidden, *value.shape[1:])
        state[key] = value
    fused.load_state_dict(state)
    (ids,), kwargs = example_inputs(fused.config, batch=2, seq=10, seed=7)
    torch.testing.assert_close(fused(ids), plain(ids))
    torch.testing.assert_close(fused(ids, **kwargs), plain(ids, **kwargs))


def test_fused_qkv_exports_dynamic_with_one_projection_and_an_unbind_per_layer():
    model = build("gpt2-tiny").train()
    config = model.config
    args, kwargs = example_inputs(config, batch=2, seq=16)
    ep = torch.export.export(model, args, kwargs, dynamic_shapes=dynamic_shapes(config.max_seq))
    assert_shapes_use_only_input_symbols(ep)
    targets = [node.target for node in ep.graph.nodes if node.op == "call_function"]
    assert targets.count(torch.ops.aten.linear.default) == 4 * config.layers + 1  # qkv, o, up, down; lm_head
    assert targets.count(torch.ops.aten.unbind.int) == config.layers
    (ids,), other = example_inputs(config, batch=5, seq=11, seed=2)
    torch.testing.assert_close(ep.module()(ids, **other), model(ids, **other))
