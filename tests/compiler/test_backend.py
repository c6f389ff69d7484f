"""``torch.compile(model, backend="primepar")`` on real gloo ranks: the same loss and gradients as one device."""

from __future__ import annotations

import pytest
from distributed_checks import ATOL, RTOL, check_backend, make

from primepar_fx.runtime.testing import spawn


def test_registered_by_name_on_one_rank():
    import torch._dynamo

    import primepar_fx  # noqa: F401  (registers the backend)

    torch._dynamo.reset()
    ref, args, kwargs = make("gpt2-tiny")
    model, _, _ = make("gpt2-tiny")
    compiled = torch.compile(model, backend="primepar")
    loss = compiled(*args, **kwargs)
    ref_loss = ref(*args, **kwargs)
    loss.backward()
    ref_loss.backward()
    assert float(loss.detach()) == pytest.approx(float(ref_loss.detach()), rel=RTOL, abs=ATOL)
    for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        assert torch.allclose(p.grad, q.grad, rtol=RTOL, atol=ATOL), name


@pytest.mark.parametrize(("world", "family"), [(2, "llama"), (4, "gpt2")])  # 4-rank HF plans: test_distributed
def test_hugging_face_on_gloo_ranks(world, family):
    plans = ["searched", "megatron"] if world == 2 else ["prime"]
    report = spawn(check_backend, world, f"hf:{family}", plans, timeout=600)
    for plan in plans:
        r = report[plan]
        assert r["loss"] == pytest.approx(report["reference_loss"], rel=RTOL, abs=ATOL), plan
        assert r["bad_grads"] == [], f"{plan}: {r['bad_grads'][:5]}"
        assert r["other"] == pytest.approx(report["reference_other"], rel=RTOL, abs=ATOL), plan
