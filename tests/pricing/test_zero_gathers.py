"""ZeRO stage 1's all-gather after the step, priced as it runs (:mod:`primepar_fx.runtime.zero`): it travels while
the next Forward computes and is waited for before its bucket's first reader, so a node pays the part of it that its
own Forward compute does not hide; its bytes are paid in full."""

from __future__ import annotations

import pytest
from opdims import linear_dims as linear

from primepar_fx.cost.blocks import CostOptions
from primepar_fx.cost.cluster import load_cluster
from primepar_fx.cost.model import node_cost, zero_gather_price
from primepar_fx.partition import DeviceMesh, OpPartition, PartitionSeq
from primepar_fx.partition.enumerate import values_key


@pytest.mark.parametrize("cluster", ["v100-paper", "cpu-gloo"])
@pytest.mark.parametrize("size", [(8, 16, 32, 64), (2, 4, 512, 512)])
def test_stage_1_pays_what_forward_does_not_hide_of_its_all_gather(cluster, size):
    spec = load_cluster(cluster)
    op = linear(*size)
    part = OpPartition(op, PartitionSeq.parse("B,B"), DeviceMesh((2, 2)))  # 4 replicas of the weight
    plain, one = (node_cost(part, None, spec, {}, CostOptions(zero=z)) for z in (0, 1))
    seconds, sent = zero_gather_price(part, 1, spec, values_key({}), 4)
    assert seconds > 0 and sent > 0
    assert dict(one.zero_gather_bytes) == {1: sent}  # the bytes in full
    exposed = max(0.0, seconds - one.phase_s[0])  # hidden behind this node's Forward compute as far as it goes
    assert dict(one.zero_gather_s)[1] == pytest.approx(exposed)
    assert one.collective_s - plain.collective_s == pytest.approx(exposed)
