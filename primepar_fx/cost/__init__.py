"""Cost model (paper §4, Eq. 7-10): intra-operator, inter-operator and memory costs per partition sequence.

Not built yet: this subpackage is reserved for the cost-model issue. The partition space it prices lives in
:mod:`primepar_fx.partition` (slices, ring transfers and collectives per phase).
"""
