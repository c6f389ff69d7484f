"""The planner's state (``planning.state``): the pricings a plan keeps stay within their bounds; the plan to beat
is looked up once, only when a search needs it."""

from __future__ import annotations

import functools
import math

from primepar_fx.api import analyze
from primepar_fx.cost.blocks import CostOptions
from primepar_fx.cost.cluster import load_cluster
from primepar_fx.frontend.symbols import B, S
from primepar_fx.models import build, example_inputs, get_config
from primepar_fx.planning import state
from primepar_fx.planning.state import Bound, KeptPricings
from primepar_fx.pricing.price import price_graph


@functools.cache
def pricing():
    config = get_config("gpt2-tiny")
    graph = analyze(build(config, device="meta"), *example_inputs(config, 2, 16))
    spec = load_cluster("cpu-gloo")
    return price_graph(graph, spec.mesh(2), spec, {B: 2, S: 16}, CostOptions())


def test_the_pricings_kept_for_reading_again_stay_within_their_bounds() -> None:
    priced = pricing()
    size = priced.array_nbytes()
    kept = KeptPricings(2)
    for key in ("a", "b", "c"):
        kept.put((key,), priced)
    assert kept.get(("a",)) is None and kept.get(("b",)) is priced is kept.get(("c",)) and kept.held == 2 * size
    kept.put(("b",), priced)  # again: replaced, not counted twice
    assert kept.held == 2 * size
    small = KeptPricings(10)
    limit = state.KEEP_PRICED
    try:
        state.KEEP_PRICED = size  # one fits, two do not
        small.put(("a",), priced)
        small.put(("b",), priced)
        assert small.get(("a",)) is None and small.get(("b",)) is priced and small.held == size
        state.KEEP_PRICED = size - 1  # none fits: not kept
        small.put(("c",), priced)
        assert small.get(("c",)) is None
    finally:
        state.KEEP_PRICED = limit


def test_the_plan_to_beat_is_looked_up_once_and_only_when_asked():
    asked = []

    def elsewhere() -> float:
        asked.append(1)
        return 8.0

    bound = Bound(4, elsewhere, known=True)
    assert bound.cutoff is not None and not bound.asked and asked == []  # nothing looked up yet
    bound.found = 3.0
    assert bound.cutoff() == 2.0 and bound.ceiling() == 2.0 and bound.asked and asked == [1]  # per micro-batch
    bound.found = 1.5
    assert bound.cutoff() == 1.5 and asked == [1]
    alone = Bound(2)
    assert alone.cutoff() == math.inf and alone.asked and not alone.known
