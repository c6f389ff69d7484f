"""Mixture-of-experts layers as one op: ``primepar::moe_experts`` (numbers, splits, capture) and its rule."""

from __future__ import annotations

import types
import warnings

import pytest
import sympy
import torch
import torch.nn.functional as F

from primepar_fx.frontend.moe import experts_as_one_op, moe_experts
from primepar_fx.frontend.symbols import B, S

T, H, I, E, K = 12, 8, 6, 4, 2


def _per_token(hidden, index, weights, up, down, up_bias, down_bias, act, gated, transposed, gate=None):
    """The definition, one token and one choice at a time (``gate(gate, value)`` instead of ``act(gate) * value``)."""
    rows = []
    for t in range(hidden.shape[0]):
        acc = torch.zeros(hidden.shape[1], dtype=hidden.dtype)
        for j in range(index.shape[1]):
            e = int(index[t, j])
            w_up = up[e] if transposed else up[e].t()
            w_down = down[e] if transposed else down[e].t()
            h = hidden[t] @ w_up + (up_bias[e] if up_bias is not None else 0)
            half = h.shape[0] // 2
            h = (gate or (lambda a, b: act(a) * b))(h[:half], h[half:]) if gated else act(h)
            acc = acc + weights[t, j] * (h @ w_down + (down_bias[e] if down_bias is not None else 0))
        rows.append(acc)
    return torch.stack(rows)


def _inputs(gated: bool, transposed: bool, bias: bool, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    u = 2 * I if gated else I
    hidden = torch.randn(T, H, generator=g, dtype=torch.float64)
    index = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    weights = torch.rand(T, K, generator=g, dtype=torch.float64)
    up = torch.randn(*((E, H, u) if transposed else (E, u, H)), generator=g, dtype=torch.float64)
    down = torch.randn(*((E, I, H) if transposed else (E, H, I)), generator=g, dtype=torch.float64)
    up_bias = torch.randn(E, u, generator=g, dtype=torch.float64) if bias else None
    down_bias = torch.randn(E, H, generator=g, dtype=torch.float64) if bias else None
    return [hidden, index, weights, up, down, up_bias, down_bias]


def _grads(out: torch.Tensor, tensors: list) -> list:
    leaves = [t for t in tensors if t is not None and t.requires_grad]
    return list(torch.autograd.grad(out, leaves, torch.linspace(-1, 1, out.numel()).view_as(out).double()))


def _leaves(tensors: list) -> list:
    return [t.clone().requires_grad_(t.is_floating_point()) if t is not None else None for t in tensors]


VARIANTS = [(True, False, False), (False, False, True), (True, True, True)]  # (gated, transposed, bias)


@pytest.mark.parametrize(("gated", "transposed", "bias"), VARIANTS)
def test_the_op_computes_the_definition_and_its_gradients(gated, transposed, bias):
    x = _leaves(_inputs(gated, transposed, bias))
    out = moe_experts(*x, "silu", gated, transposed, 0)
    ref = _leaves(_inputs(gated, transposed, bias))
    want = _per_token(*ref, F.silu, gated, transposed)
    torch.testing.assert_close(out, want)
    for got, exp in zip(_grads(out, x), _grads(want, ref)):
        torch.testing.assert_close(got, exp)


def test_split_experts_and_intermediate_sum_to_the_whole():
    """What a device computes from its experts [lo, hi) (expert_lo) or its slice of each expert's intermediate
    (the rows [gate_i; up_i]) sums over the devices to the whole op, in value and in every gradient."""
    x = _leaves(_inputs(True, False, False))
    whole = moe_experts(*x, "gelu", True, False, 0)
    hidden, index, weights, up, down = x[:5]
    by_experts = sum(
        moe_experts(hidden, index, weights, up[lo : lo + 2], down[lo : lo + 2], None, None, "gelu", True, False, lo)
        for lo in (0, 2)
    )
    torch.testing.assert_close(by_experts, whole)
    halves = ((0, 3), (3, 6))
    by_inter = sum(
        moe_experts(
            hidden, index, weights, torch.cat([up[:, a:b], up[:, I + a : I + b]], dim=1), down[:, :, a:b],
            None, None, "gelu", True, False, 0,
        )
        for a, b in halves
    )  # fmt: skip
    torch.testing.assert_close(by_inter, whole)
    seed = torch.linspace(-1, 1, whole.numel()).view_as(whole).double()
    g_whole = torch.autograd.grad(whole, [hidden, weights, up, down], seed)
    g_split = torch.autograd.grad(by_experts, [hidden, weights, up, down], seed)
    for a, b in zip(g_split, g_whole):
        torch.testing.assert_close(a, b)


def _clamped_swiglu(gate, value, alpha=1.702, limit=0.5):
    """gpt-oss's gate (``GptOssExperts._apply_gate``), written out: a small limit so that both clamps bite."""
    gate, value = gate.clamp(max=limit), value.clamp(min=-limit, max=limit)
    return (value + 1) * gate * torch.sigmoid(gate * alpha)


def test_interleaved_rows_with_gpt_oss_gate_compute_the_definition_and_split_by_intermediate():
    """gpt-oss's experts: up rows alternating gate and value (``interleaved``) and its clamped SwiGLU, against the
    definition with the rows de-interleaved; a device holding the interleaved rows of its slice of the intermediate
    (a contiguous block of ``U``, what a split of ``I`` in ``(I, G)`` gives it) computes its part of the sum."""
    x = _leaves(_inputs(True, True, True))
    hidden, index, weights, up, down, up_bias, down_bias = x
    act = "clamped_swiglu:1.702:0.5"
    out = moe_experts(*x, act, True, True, 0, True)
    order = torch.cat([torch.arange(0, 2 * I, 2), torch.arange(1, 2 * I, 2)])  # interleaved -> [gates; values]
    ref = _leaves([hidden, index, weights, up[..., order], down, up_bias[:, order], down_bias])
    want = _per_token(*ref, None, True, True, gate=_clamped_swiglu)
    torch.testing.assert_close(out, want)
    for got, exp in zip(_grads(out, x), _grads(want, ref)):
        if got.shape == exp.shape and got.shape[-1] == 2 * I:
            exp = exp[..., torch.argsort(order)]  # back to the interleaved rows
        torch.testing.assert_close(got, exp)
    by_inter = sum(
        moe_experts(
            hidden, index, weights, up[..., 2 * a : 2 * b], down[:, a:b], up_bias[:, 2 * a : 2 * b],
            down_bias if a == 0 else None, act, True, True, 0, True,
        )
        for a, b in ((0, 3), (3, 6))
    )  # fmt: skip
    torch.testing.assert_close(by_inter, out)


def test_a_device_whose_experts_no_token_reached_gives_zeros():
    x = _inputs(True, False, False)
    hidden, index, weights, up, down = x[:5]
    leaves = _leaves([hidden, weights, up[2:], down[2:]])
    out = moe_experts(leaves[0], torch.zeros_like(index), *leaves[1:], None, None, "silu", True, False, 2)
    assert torch.count_nonzero(out) == 0
    grads = torch.autograd.grad(out.sum(), leaves)  # and every gradient is zero
    assert all(torch.count_nonzero(g) == 0 and g.shape == t.shape for g, t in zip(grads, leaves))


def _tiny_mixtral():
    transformers = pytest.importorskip("transformers")
    from primepar_fx.models import build_hf_tiny

    del transformers
    return build_hf_tiny("mixtral")


def test_capture_takes_the_experts_as_one_op_and_puts_the_module_back():
    from primepar_fx.frontend.capture import capture
    from primepar_fx.models import hf_example_inputs

    model = _tiny_mixtral()
    args, kwargs = hf_example_inputs(model, 2, 8)
    with torch.no_grad():
        before = model(*args, **kwargs).loss
    captured = capture(model, args, kwargs)
    targets = [n.target for n in captured.gm.graph.nodes if n.op == "call_function"]
    assert targets.count(torch.ops.primepar.moe_experts.default) == model.config.num_hidden_layers
    assert torch.ops.aten.histc.default not in targets
    experts = [m for m in model.modules() if type(m).__name__ == "MixtralExperts"]
    assert experts and all("forward" not in vars(m) for m in experts)  # transformers' forward again
    with torch.no_grad():
        assert torch.equal(model(*args, **kwargs).loss, before)


def test_an_expert_it_cannot_run_is_left_to_transformers_with_a_warning():
    model = _tiny_mixtral()
    experts = next(m for m in model.modules() if type(m).__name__ == "MixtralExperts")
    experts.config = type(experts.config).from_dict({**experts.config.to_dict(), "hidden_act": "tanh"})
    with warnings.catch_warnings(record=True) as caught, experts_as_one_op(model) as taken:
        warnings.simplefilter("always")
        assert "model.layers.0.mlp.experts" not in taken and "model.layers.1.mlp.experts" in taken
    assert any("the activation 'tanh'" in str(w.message) and "layers.0" in str(w.message) for w in caught)


@pytest.mark.parametrize(
    ("act_fn", "name"),
    [(F.silu, "silu"), (torch.nn.SiLU(), "silu"), (torch.nn.GELU(approximate="tanh"), "gelu_pytorch_tanh"),
     (torch.nn.Tanh(), None)],
)  # fmt: skip
def test_experts_without_a_hidden_act_in_their_config_are_named_by_their_act_fn(act_fn, name):
    """LFM2-MoE's config has no ``hidden_act``: its experts are run with the activation their ``act_fn`` is, and
    one that has no name here leaves them to transformers."""
    from primepar_fx.frontend.moe import _activation

    model = _tiny_mixtral()
    experts = next(m for m in model.modules() if type(m).__name__ == "MixtralExperts")
    experts.config = types.SimpleNamespace()  # as LFM2-MoE's: no hidden_act
    del experts.act_fn  # a child module here; LFM2-MoE's is a function
    experts.act_fn = act_fn
    assert _activation(experts) == str(name)
    with warnings.catch_warnings(record=True), experts_as_one_op(model) as taken:
        warnings.simplefilter("always")
        assert ("model.layers.0.mlp.experts" in taken) == (name is not None)


def test_the_rule_splits_tokens_choices_experts_and_intermediate_not_hidden():
    from primepar_fx.frontend.capture import capture
    from primepar_fx.graph.build import build_graph
    from primepar_fx.models import hf_example_inputs

    model = _tiny_mixtral()
    args, kwargs = hf_example_inputs(model, 2, 8)
    graph = build_graph(capture(model, args, kwargs))
    node = graph.nodes["moe_experts"]
    dims = node.dims
    config = model.config
    e, i, h, k = config.num_local_experts, config.intermediate_size, config.hidden_size, config.num_experts_per_tok
    assert dict(zip(dims.dims, dims.sizes)) == {"BS": B * S, "H": h, "k": k, "E": e, "G": 2, "I": i}
    assert dims.inputs == (
        (("BS",), ("H",)),  # hidden
        (("BS",), ("k",)),  # top_k_index
        (("BS",), ("k",)),  # top_k_weights
        (("E",), ("G", "I"), ("H",)),  # [gate; up]
        (("E",), ("H",), ("I",)),  # down
    )
    assert dims.outputs == ((("BS",), ("H",)),)
    assert dims.no_split == {"H", "G"}
    assert dims.weights == {3, 4} and dims.no_grad == {1}
    assert sympy.simplify(dims.flops - 2 * B * S * k * h * (2 * i + i)) == 0
    assert dims.extra["recomputes"] is True


def test_gpt_oss_experts_are_one_op_with_interleaved_rows_and_their_biases_keep_the_intermediate_whole():
    """gpt-oss's experts (transposed, interleaved gate/value rows, biases, a clamped gate) run as the one op and
    compute what transformers does; the up rows map to ``(I, G)``, and the down bias, which every device summing
    over a split ``I`` would add once more, keeps ``I`` whole."""
    pytest.importorskip("transformers")
    from primepar_fx.frontend.capture import capture
    from primepar_fx.graph.build import build_graph
    from primepar_fx.models import build_hf_tiny, hf_example_inputs

    model = build_hf_tiny("gpt_oss")
    args, kwargs = hf_example_inputs(model, 2, 8)
    with torch.no_grad():
        want = model(*args, **kwargs).loss
        with experts_as_one_op(model) as taken:
            assert taken == [f"model.layers.{i}.mlp.experts" for i in range(model.config.num_hidden_layers)]
            torch.testing.assert_close(model(*args, **kwargs).loss, want)
    dims = build_graph(capture(model, args, kwargs)).nodes["moe_experts"].dims
    assert dims.inputs[3] == (("E",), ("H",), ("I", "G"))  # [E, H, U] transposed, U = (I, G) interleaved
    assert dims.inputs[5:] == ((("E",), ("I", "G")), (("E",), ("H",)))  # the up and down biases
    assert dims.no_split == {"H", "G", "I"}
