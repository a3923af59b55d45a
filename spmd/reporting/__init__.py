"""What a compiled step shows of itself: ``report`` (:class:`~spmd.StepReport`, read off a graph
stage, never by running it) and ``dump`` (every stage as annotated Python, and the report).

Both read the graphs the other stages leave; :mod:`spmd.api` calls them (``train_step.report()``,
``dump_dir=``), and so do the tools (:mod:`spmd.simulate`, :mod:`spmd.plan`). They import the
partitioner's placements (:mod:`spmd.parallel`), never the api or the tools.
"""
