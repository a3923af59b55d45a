"""Every error the library raises on purpose derives from :class:`SpmdError`.

Each message names the cause (the op, the module path, the user's source line when
the trace knows it) and says what to do about it.
"""

from __future__ import annotations


class SpmdError(RuntimeError):
    """Base class of all errors raised by spmd."""


class InvalidArgumentsError(SpmdError, TypeError):
    """The decorated function was called with arguments spmd cannot map to a train step."""


class ConfigError(SpmdError, ValueError):
    """An unknown parallel style, knob or option value."""


def check_choice(option: str, value: object, choices: tuple[str, ...], meaning: str) -> str:
    """``value`` if it is one of ``choices``; else a ``ConfigError`` naming the option, the
    choices and what each means (``meaning``, a sentence in parentheses)."""
    if value not in choices:
        raise ConfigError(
            f"spmd.compile: {option}={value!r} is not supported; use one of {list(choices)} ({meaning})."
        )
    return str(value)


class TraceError(SpmdError):
    """The train step could not be traced into one graph."""


class DataDependentControlFlowError(TraceError):
    """Python control flow depended on a tensor's value (``.item()``, ``if tensor:``)."""


class HostRandomError(TraceError):
    """The step drew from numpy's or Python's global random generator while traced: the graph
    would replay that one draw at every step (``spmd.frontend.host_random``)."""


class CapturedTensorError(TraceError):
    """The step read a tensor from outside (a global, a closure variable, a module attribute
    that is not a buffer): names it and the fix (pass it as an argument, or register a buffer)."""


class UntraceableOpError(TraceError):
    """An operation has no meta/fake implementation or a data-dependent output shape."""


class DataCheckError(SpmdError):
    """A batch would take another side of a Python branch on the step's data (``if labels.max() >=
    vocab:``) than the graph traced on the first call; raised on every rank before the step runs
    (``spmd.frontend.data_checks``)."""


class CacheLimitError(SpmdError):
    """Too many distinct input signatures were traced for one compiled step."""


class ModelChangedError(SpmdError):
    """The model or optimizer changed after compilation in a way spmd cannot follow."""


class RankDivergenceError(SpmdError):
    """Ranks compiled different collective sequences; running them would hang."""


class CollectiveError(SpmdError):
    """A collective failed or timed out while a compiled step ran: a peer rank died or diverged."""


class KernelError(SpmdError):
    """An op of the compiled graph failed on real tensors although the trace (on fake tensors,
    whose kernels check less) accepted it; names the op, its module path and source line."""


class PassError(SpmdError):
    """A graph pass failed or broke a graph invariant."""


class ShardingPropagationError(SpmdError):
    """DTensor cannot propagate declared placements through an op of the step (no strategy, or a
    redistribution the mesh cannot do); names the op, the module path, the source line and the
    placements."""


class LoweringError(SpmdError):
    """A backend (inductor) could not compile the final graph, or changed its collective order."""


class StalePrefetchError(SpmdError):
    """With ``cross_step_prefetch`` and invariant checks on: parameter shards the carried
    all-gather read were changed between calls in a way spmd cannot see (no version counter
    bumped); names the fix (``train_step.invalidate_prefetch()`` on every rank)."""
