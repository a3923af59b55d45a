"""``spmd.simulate``: compile a train step for any world size on one process, and report on it.

    >>> report = spmd.simulate(train_step, model, optim, x, y, world_size=1024)
    >>> print(report)                # collectives, bytes per rank, predicted peak memory

The step is lowered (traced, partitioned, passed; never run) under the fake
process group, which answers every collective instantly, so the graph rank 0 would
run at ``world_size`` ranks is built on this one process. It works on copies of the
arguments made as fake tensors (``FakeCopyMode``): the caller's model and optimizer
are left as they are, and no memory is needed for the weights or the optimizer
state, however large the model. (Build a big model under ``FakeTensorMode`` in the
first place so that it takes no memory either; see ``spmd.models.build``.)

The command line simulates the built-in models of :mod:`spmd.models`:

    python -m spmd.simulate --model gpt2-small --world-size 1024 --style fully_shard
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import inspect
import logging
import time
from collections.abc import Iterator
from typing import Any

import torch.distributed as dist
from torch.distributed.tensor import DTensor

from passes.cost_model import DeviceProfile
from passes.torch_compat import FakeCopyMode, FakeTensorMode
from spmd.api import CompiledStep
from spmd.errors import ConfigError, SpmdError
from spmd.frontend import step_inputs
from spmd.parallel import sharding
from spmd.profiles import get_profile
from spmd.reporting.report import StepReport

log = logging.getLogger("spmd")

__all__ = ["simulate"]


def simulate(
    train_step: CompiledStep,
    *example_args: Any,
    world_size: int,
    device: str | DeviceProfile | None = None,
    step_kwargs: dict[str, Any] | None = None,
    **kwargs: Any,
) -> StepReport:
    """The :class:`StepReport` of ``train_step`` on ``world_size`` ranks (rank 0's view).

    Args:
        train_step: a function decorated with ``spmd.compile(...)``; its parallel mode and
            options are used (a ``mesh=`` of the mode is dropped: simulation makes its own).
        *example_args: the positional arguments of one call, as rank 0 would pass them
            (the model, the optimizer, rank 0's local batch). They are copied, not changed.
        step_kwargs: the keyword arguments of that call, copied likewise: the way to pass
            one named like simulate's own (``world_size``, ``device``).
        **kwargs: the same, as keywords (kept for compatibility; not together with
            ``step_kwargs``). A step whose function takes a parameter named like one of
            simulate's keywords given here must get its keywords through ``step_kwargs``
            (``step_kwargs={}`` for none): :class:`~spmd.ConfigError` otherwise.
        world_size: how many ranks to simulate.
        device: the device the ranks run on, as ``spmd.plan`` takes it (a profile name such as
            ``"h100-80gb"``, a profile json path or a :class:`~passes.cost_model.DeviceProfile`):
            the step is lowered with that device's rules (on an accelerator, the chunked loss
            head's larger chunks: :func:`passes.linear_cross_entropy.default_chunk`), though it
            traces on the CPU. None: the rules of the devices the arguments are on (the CPU's
            for a model built on the CPU or under ``FakeTensorMode``).

    Must be called with no process group initialised (it initialises the fake one and
    destroys it afterwards). ``train_step`` itself is not changed: its graph cache and
    ``graphs`` stay as they were, and nothing is dumped.
    """
    kwargs = step_keywords(
        "spmd.simulate", train_step, example_args, step_kwargs, kwargs, given_keywords(simulate, locals())
    )
    check_call("spmd.simulate", train_step, world_size, example_args, kwargs)
    sim = fresh_copy(train_step)
    if device is not None:
        sim._target_profile = get_profile(device)
        sim._target_accelerator = sim._target_profile.accelerator
    args, kwargs = fake_copy(example_args, kwargs)
    with fake_world(world_size):
        t0 = time.perf_counter()
        sim.lower(*args, **kwargs)
        report = sim.report()
        log.info(
            "spmd.simulate: %s at world size %d in %.2f s",
            getattr(sim, "__name__", "step"),
            world_size,
            time.perf_counter() - t0,
        )
    return report


def given_keywords(fn: Any, values: dict[str, Any]) -> list[str]:
    """The keyword-only parameters of ``fn`` (``spmd.simulate``, ``spmd.plan``) whose value in
    ``values`` (its ``locals()`` on entry) is not the default: the names a call gave it."""
    out = []
    for name, p in inspect.signature(fn).parameters.items():
        if p.kind is not inspect.Parameter.KEYWORD_ONLY or name == "step_kwargs":
            continue
        v = values[name]
        if p.default is inspect.Parameter.empty or v is not p.default and not _equal(v, p.default):
            out.append(name)
    return out


def _equal(a: Any, b: Any) -> bool:
    try:
        return bool(a == b)
    except Exception:  # a value whose == is not a bool (a tensor)
        return False


def step_keywords(
    who: str,
    train_step: Any,
    example_args: tuple[Any, ...],
    step_kwargs: dict[str, Any] | None,
    kwargs: dict[str, Any],
    own: list[str],
) -> dict[str, Any]:
    """The keyword arguments of the step's call: ``step_kwargs``, or else the extra keywords
    ``kwargs`` -- unless the step's function takes a parameter named like one of ``own`` (the
    keywords ``who`` was given), which the call cannot have meant for the step and ``who``
    alike: then a :class:`ConfigError` asks for ``step_kwargs``."""
    if step_kwargs is not None:
        if kwargs:
            raise ConfigError(
                f"{who}: the step's keyword arguments are given both in step_kwargs= and as keywords "
                f"({sorted(kwargs)}); put them all in step_kwargs."
            )
        if not isinstance(step_kwargs, dict):
            raise ConfigError(f"{who}: step_kwargs must be a dict, got {type(step_kwargs).__name__}.")
        return dict(step_kwargs)
    fn = getattr(train_step, "fn", None)
    try:
        params = inspect.signature(fn).parameters if fn is not None else {}
    except (TypeError, ValueError):  # a callable without a signature
        params = {}
    positional = [n for n, p in params.items() if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    filled = set(positional[: len(example_args)])
    keyword_kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    clash = [n for n in own if n in params and params[n].kind in keyword_kinds and n not in filled]
    if clash:
        name = clash[0]
        raise ConfigError(
            f"{who}: the step ({getattr(fn, '__name__', 'train_step')}) takes an argument named "
            f"{name!r}, like {who}'s own {name}=: the {name}= of this call is {who}'s, and the step "
            f"would not get one. Pass the step's keyword arguments as step_kwargs= "
            f"(e.g. {who}(step, *args, {name}=..., step_kwargs={{{name!r}: ...}}), or step_kwargs={{}} "
            "to give the step none)."
        )
    return kwargs


def check_call(
    who: str, train_step: Any, world_size: Any, example_args: tuple[Any, ...], kwargs: dict[str, Any]
) -> None:
    """Refuse what a simulation cannot take, naming the fix (shared with ``spmd.plan``)."""
    if not isinstance(train_step, CompiledStep):
        raise ConfigError(
            f"{who}: train_step must be a function decorated with @spmd.compile(...), got "
            f"{type(train_step).__name__}. Decorate it, e.g. {who}(spmd.compile()(fn), ...)."
        )
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ConfigError(f"{who}: world_size must be a positive int, got {world_size!r}.")
    if dist.is_available() and dist.is_initialized():
        raise SpmdError(
            f"{who}: a process group is already initialised (world size "
            f"{dist.get_world_size()}); simulation runs under its own fake process group. Call "
            f"{who} before torch.distributed.init_process_group, or in a separate process."
        )
    step_args = step_inputs.split_args(example_args, kwargs)
    if any(isinstance(p, DTensor) for p in step_args.module.parameters()):
        raise ConfigError(
            f"{who}: the model's parameters are already distributed (DTensors), from a compiled "
            "call under a real process group. Simulate with a freshly built model."
        )


def fake_copy(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Copies of a call's arguments as fake tensors (no memory; the originals untouched).

    One deepcopy of everything keeps the sharing (the optimizer holds the copied parameters).
    """
    with FakeCopyMode(FakeTensorMode(allow_non_fake_inputs=True)):
        return copy.deepcopy((args, kwargs))


@contextlib.contextmanager
def fake_world(world_size: int) -> Iterator[None]:
    """The fake process group of ``world_size`` ranks (this process is rank 0), destroyed on exit."""
    # sharding.default_mesh caches a mesh per device type; one from a destroyed group is stale.
    saved_meshes = dict(sharding._DEFAULT_MESHES)
    sharding._DEFAULT_MESHES.clear()
    from passes.torch_compat import FakeStore

    dist.init_process_group("fake", rank=0, world_size=world_size, store=FakeStore())
    try:
        yield
    finally:
        dist.destroy_process_group()
        sharding._DEFAULT_MESHES.clear()
        sharding._DEFAULT_MESHES.update(saved_meshes)


def fresh_copy(step: CompiledStep) -> CompiledStep:
    """``step``'s configuration with an empty graph cache, dumping nothing, and never lowered
    by its backend: with ``backend="inductor"`` the graph is the inductor pipeline's, as inductor
    would get it, but inductor's compile (minutes per configuration) does not run -- the report
    and the plan read the graph before inductor (``StepReport.peak_from`` says so)."""
    sim = copy.copy(step)
    sim._cache = {}
    sim._last = None
    sim._overridden = set()
    sim.dump_dir = None
    sim._lower_backend = False
    mode = step.parallel_mode
    mesh = getattr(mode, "mesh", None)
    # A DeviceMesh belongs to the caller's process group; a shape (DTensorExpandMode) is kept.
    if dataclasses.is_dataclass(mode) and mesh is not None and not isinstance(mesh, dict | tuple | list):
        sim.parallel_mode = dataclasses.replace(mode, mesh=None)  # type: ignore[type-var]
    return sim
