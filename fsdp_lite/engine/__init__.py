"""The engine: sharded parameters, units, their collectives and the step's runtime.

It knows nothing of either front (fronts/), of state dicts (state/) or of the tools that watch it
(tools/): a lower layer never imports a higher one (tests/test_import_graph.py).
"""
