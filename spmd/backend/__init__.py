"""The back end: what turns the final graph into the running step, call after call.

``runtime`` (feed the final graph the real tensors and run it; the checks around the run),
``lowering`` with ``inductor_rewrites`` and ``compile_once`` (``backend="inductor"``: compile the
final graph, one compile per host), ``carry`` (the all-gathers carried between calls) and
``lastcall`` (the fast path of an unchanged cached call). Imports the front end
(:mod:`spmd.frontend`) and the partitioner (:mod:`spmd.parallel`), never the api or the tools.
"""
