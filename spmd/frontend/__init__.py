"""The front end: a train step's arguments, traced into one graph, and the guards that say when to retrace.

``step_inputs`` (the step's arguments and the state lifted into graph inputs), ``optim``
(what tracing needs from ``torch.optim``), ``trace_hooks`` and ``tracing`` (``make_fx`` of the
whole step, every node's role, phase and module), ``hf_compat`` (the Hugging Face shim) and
``guards`` (the attributes the trace read). Imports only :mod:`spmd.errors` from the rest of
spmd; every later stage may import it.
"""
