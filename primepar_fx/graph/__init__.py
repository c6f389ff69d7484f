"""The operator graph: the captured graph with every node's dims from its rule (what every later stage reads).

* :mod:`~primepar_fx.graph.build` — :class:`OpGraph`, :class:`OpNode` and :func:`build_graph`.
* :mod:`~primepar_fx.graph.replicate` — capture two layers of a deep model and write out the whole graph.
"""

from primepar_fx.graph.build import LayerStack, OpGraph, OpNode, build_graph, check_fallback, graph_of

__all__ = ["LayerStack", "OpGraph", "OpNode", "build_graph", "check_fallback", "graph_of"]
