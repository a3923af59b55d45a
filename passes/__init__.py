"""Pure ``fx.GraphModule -> fx.GraphModule`` transforms and analyses.

This package never imports ``spmd``: it knows graphs, collectives and node
metadata (:mod:`passes.meta`), not models or optimizers.
"""
