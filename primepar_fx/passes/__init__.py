"""Graph passes (GraphModule -> GraphModule): sharding, collectives and ring operators.

Not built yet: reserved for the runtime issue.
"""
