"""Per-rank runtime on torch.distributed: process groups per digit pattern, collectives, the P(S x S) ring op.

Not built yet: reserved for the runtime issue.
"""
