"""Every private torch name and version-dependent torch behaviour that spmd and passes use, in one place.

Why here: ``passes/`` never imports ``spmd``, but ``spmd`` imports ``passes``, so this is the one module both
can import. Everything else in ``spmd/`` and ``passes/`` imports these names from here instead of reaching
into ``torch._...`` or a torch object's ``._private`` attribute itself; ``tests/unit/test_torch_compat.py``
checks both (each name in :data:`PRIVATE_NAMES` and :data:`PRIVATE_ATTRIBUTES` still resolves, and no other
module touches a private torch name). When a torch release moves one of these, the fix is a branch on
:data:`TORCH_VERSION` here, and nowhere else.

Names torch itself imports at ``import torch`` are imported eagerly (real types for mypy); heavier ones
(inductor, dynamo, DTensor internals, DCP, the test-only fake store, functorch's knapsack) resolve on first
use through the module ``__getattr__``, so ``import passes`` stays as cheap as before.

Every entry says the torch versions it was checked on (``make test-torch TORCH=...``; see
``docs/torch-versions.md``). The supported range is torch 2.11 to 2.15 (``pyproject.toml``).

ATen operators whose names start with ``_`` (``aten._log_softmax``, ``_c10d_functional``) are the
vocabulary of the traced graphs, not Python APIs; they are listed in :data:`PRIVATE_OPS` (checked to exist)
and used in place.
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch._guards import detect_fake_mode
from torch._ops import HigherOrderOperator, OpOverload
from torch._prims_common import suggest_memory_format
from torch._subclasses import fake_tensor
from torch._subclasses.fake_tensor import (
    DynamicOutputShapeException,
    FakeCopyMode,
    FakeTensor,
    FakeTensorMode,
    unset_fake_temporarily,
)
from torch.nn.utils.stateless import _reparametrize_module as reparametrize_module

__all__ = [
    "DynamicOutputShapeException",
    "FakeCopyMode",
    "FakeTensor",
    "FakeTensorMode",
    "HigherOrderOperator",
    "OpOverload",
    "PRIVATE_ATTRIBUTES",
    "PRIVATE_NAMES",
    "PRIVATE_OPS",
    "TORCH_VERSION",
    "detect_fake_mode",
    "fake_tensor",
    "pytree",
    "reparametrize_module",
    "suggest_memory_format",
    "unset_fake_temporarily",
]

#: (major, minor) of the running torch, for the version branches below.
TORCH_VERSION: tuple[int, int] = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])  # type: ignore[assignment]

#: The torch versions every entry below was checked on, unless the entry says otherwise (that each name and
#: attribute exists: ``tests/unit/test_torch_compat.py``; 2.11.0 and 2.12.1 since 2026-11-29).
CHECKED = "2.11.0, 2.12.1, 2.13.0, 2.14.1, 2.15.0"


@dataclass(frozen=True)
class Private:
    """One private torch name: ``module`` (importable) and ``attr`` in it (``""``: the module itself)."""

    module: str
    attr: str = ""
    checked: str = CHECKED

    def resolve(self) -> Any:
        obj = importlib.import_module(self.module)
        return getattr(obj, self.attr) if self.attr else obj


#: Our name -> where it lives in torch. Both the eager imports above and the lazy ones of __getattr__.
PRIVATE_NAMES: dict[str, Private] = {
    # eager (torch imports these itself)
    "pytree": Private("torch.utils._pytree"),
    "detect_fake_mode": Private("torch._guards", "detect_fake_mode"),
    "HigherOrderOperator": Private("torch._ops", "HigherOrderOperator"),
    "OpOverload": Private("torch._ops", "OpOverload"),
    "suggest_memory_format": Private("torch._prims_common", "suggest_memory_format"),
    "fake_tensor": Private("torch._subclasses.fake_tensor"),
    "DynamicOutputShapeException": Private("torch._subclasses.fake_tensor", "DynamicOutputShapeException"),
    "FakeCopyMode": Private("torch._subclasses.fake_tensor", "FakeCopyMode"),
    "FakeTensor": Private("torch._subclasses.fake_tensor", "FakeTensor"),
    "FakeTensorMode": Private("torch._subclasses.fake_tensor", "FakeTensorMode"),
    "unset_fake_temporarily": Private("torch._subclasses.fake_tensor", "unset_fake_temporarily"),
    "reparametrize_module": Private("torch.nn.utils.stateless", "_reparametrize_module"),
    # lazy (resolved on first use by __getattr__)
    "LazyGraphModule": Private("torch.fx._lazy_graph_module", "_LazyGraphModule"),
    "TracingContext": Private("torch._guards", "TracingContext"),
    "tracing": Private("torch._guards", "tracing"),
    "dispatch_has_kernel_for_dispatch_key": Private("torch._C", "_dispatch_has_kernel_for_dispatch_key"),
    "TensorBase": Private("torch._C", "TensorBase"),
    # Dispatch below the Autograd keys (ADInplaceOrView still runs: version counters, view bases).
    "AutoDispatchBelowAutograd": Private("torch._C", "_AutoDispatchBelowAutograd"),
    "foreach_copy_": Private("torch", "_foreach_copy_"),
    # ``cat`` of every tensor flattened in logical order, in one C++ call (c10d's bucket flattener).
    "flatten_dense_tensors": Private("torch._C._nn", "flatten_dense_tensors"),
    "fused_adamw_": Private("torch", "_fused_adamw_"),
    "inductor_config": Private("torch._inductor.config"),
    "compile_fx": Private("torch._inductor.compile_fx", "compile_fx"),
    "GraphLowering": Private("torch._inductor.graph", "GraphLowering"),
    "inductor_cache_dir": Private("torch._inductor.runtime.cache_dir_utils", "cache_dir"),
    "dynamo_counters": Private("torch._dynamo.utils", "counters"),
    "dp_knapsack": Private("torch._functorch._activation_checkpointing.knapsack", "dp_knapsack"),
    "get_default_group": Private("torch.distributed.distributed_c10d", "_get_default_group"),
    "get_default_store": Private("torch.distributed.distributed_c10d", "_get_default_store"),
    "resolve_process_group": Private("torch.distributed.distributed_c10d", "_resolve_process_group"),
    "DTensorSpec": Private("torch.distributed.tensor._dtensor_spec", "DTensorSpec"),
    "TensorMeta": Private("torch.distributed.tensor._dtensor_spec", "TensorMeta"),
    "StridedShard": Private("torch.distributed.tensor.placement_types", "_StridedShard"),
    "OpSchema": Private("torch.distributed.tensor._op_schema", "OpSchema"),
    "OpStrategy": Private("torch.distributed.tensor._op_schema", "OpStrategy"),
    "OpSpec": Private("torch.distributed.tensor._op_schema", "OpSpec"),
    "RuntimeSchemaInfo": Private("torch.distributed.tensor._op_schema", "RuntimeSchemaInfo"),
    "StrategyType": Private("torch.distributed.tensor._op_schema", "StrategyType"),
    # DTensor's pointwise strategy for a list op (see register_list_pointwise): torch 2.12 added the first.
    **(
        {
            "register_single_dim_pointwise": Private(
                "torch.distributed.tensor._ops._pointwise_ops", "_register_single_dim_pointwise"
            )
        }
        if TORCH_VERSION >= (2, 12)
        else {
            "list_pointwise_strategy": Private(
                "torch.distributed.tensor._ops._pointwise_ops", "list_pointwise_strategy", "2.11.0"
            )
        }
    ),
    "expand_to_full_mesh_op_strategy": Private(
        "torch.distributed.tensor._ops.utils", "expand_to_full_mesh_op_strategy"
    ),
    "register_op_strategy": Private("torch.distributed.tensor._ops.utils", "register_op_strategy"),
    "dcp_state_dict_loader": Private("torch.distributed.checkpoint.state_dict_loader"),
    "FakeStore": Private("torch.testing._internal.distributed.fake_pg", "FakeStore"),
}

#: Private attributes of torch objects that spmd reads or writes, through the helpers below:
#: attribute -> (the torch class or module that has it, checked on).
PRIVATE_ATTRIBUTES: dict[str, tuple[str, str]] = {
    "_is_compiling_flag": ("torch.compiler", CHECKED),
    "_flatten": ("torch.distributed.device_mesh.DeviceMesh", CHECKED),
    "_load_state_dict": ("torch.distributed.checkpoint.state_dict_loader", CHECKED),
    "_global_forward_hooks": ("torch.nn.modules.module", CHECKED),
    "_global_forward_pre_hooks": ("torch.nn.modules.module", CHECKED),
    "_global_backward_hooks": ("torch.nn.modules.module", CHECKED),
    "_global_backward_pre_hooks": ("torch.nn.modules.module", CHECKED),
    "_schema": ("torch._ops.OpOverload", CHECKED),
    "_overloadname": ("torch._ops.OpOverload", CHECKED),
    "_op": ("torch._ops.OpOverload", CHECKED),
    "_local_tensor": ("torch.distributed.tensor.DTensor", CHECKED),
    "_parameters": ("torch.nn.Module", CHECKED),
    "_buffers": ("torch.nn.Module", CHECKED),
    "_modules": ("torch.nn.Module", CHECKED),
    "_rename": ("torch.fx.Node", CHECKED),
    "_set_current_node": ("torch.fx.Interpreter", CHECKED),
    "_sequence_nr": ("torch.autograd.graph.Node", CHECKED),
    "_cdata": ("torch.UntypedStorage", CHECKED),
    "_Options": ("torch.distributed.ProcessGroupGloo", CHECKED),
    "_threads": ("torch.distributed.ProcessGroupGloo._Options", CHECKED),
    "_devices": ("torch.distributed.ProcessGroupGloo._Options", CHECKED),
    "_timeout": ("torch.distributed.ProcessGroupGloo._Options", CHECKED),
    "_device_types": ("torch.distributed.ProcessGroup", CHECKED),
    "_get_backend": ("torch.distributed.ProcessGroup", CHECKED),
}

#: ATen / functional-collective operators with a leading underscore that graphs are matched on or built
#: with: "namespace.op" (checked to exist on the running torch).
PRIVATE_OPS: tuple[str, ...] = (
    "_c10d_functional.all_reduce_",
    "_c10d_functional.wait_tensor",
    "aten._chunk_cat",
    "aten._convolution",
    "aten._ctc_loss",
    "aten._ctc_loss_backward",
    "aten._efficient_attention_forward",
    "aten._flash_attention_forward",
    "aten._foreach_add_",
    "aten._foreach_norm",
    "aten._fused_adam_",
    "aten._fused_adamw_",
    "aten._fused_sgd_",
    "aten._grouped_mm",
    "aten._log_softmax",
    "aten._log_softmax_backward_data",
    "aten._native_batch_norm_legit",
    "aten._native_batch_norm_legit_functional",
    "aten._native_batch_norm_legit_no_training",
    "aten._scaled_dot_product_attention_math",
    "aten._scaled_dot_product_cudnn_attention",
    "aten._scaled_dot_product_efficient_attention",
    "aten._scaled_dot_product_flash_attention",
    "aten._scaled_dot_product_flash_attention_for_cpu",
    "aten._scaled_dot_product_flash_attention_for_cpu_backward",
    "aten._scaled_mm",
    "aten._softmax",
    "aten._softmax_backward_data",
    "aten._to_copy",
    "aten._unsafe_view",
    "mkldnn._linear_pointwise",
)

_EAGER = {n for n in __all__ if n in PRIVATE_NAMES}

# --- version-dependent behaviour ---------------------------------------------------------------------

_aten = torch.ops.aten

#: The ops a traced ``Tensor.detach()`` records: ``aten.detach`` through torch 2.13, ``aten.alias`` from
#: 2.14 on (checked on 2.13.0 and 2.14.1). Both are no-op views, so code that steps over a detach steps
#: over either, on every version.
DETACH_OPS = frozenset({_aten.detach.default, _aten.alias.default})

#: CPU norm kernels that write their output in the input's suggested memory format (channels_last for an
#: NHWC-strided input) where torch's fake kernel follows the input's strides: op -> the argument whose
#: format counts. Batch norm on every version; ``native_group_norm`` from torch 2.14 on (2.13.0's kernel
#: returns a contiguous output, 2.14.1's a channels_last one: ``tests/unit/test_kernel_layouts.py``).
CPU_SUGGESTED_FORMAT_NORM_OPS: dict[Any, int] = {
    _aten.native_batch_norm.default: 0,
    _aten._native_batch_norm_legit.default: 0,
    _aten._native_batch_norm_legit.no_stats: 0,
    _aten._native_batch_norm_legit_no_training.default: 0,
    _aten._native_batch_norm_legit_functional.default: 0,
    _aten.native_batch_norm_backward.default: 1,  # (grad_out, input, ...)
    **({_aten.native_group_norm.default: 0} if TORCH_VERSION >= (2, 14) else {}),
}

#: ``native_group_norm_backward`` on the CPU reads a non-contiguous output gradient as if it were
#: contiguous (silently wrong values) through torch 2.13; 2.14.1 reads it right. ``passes.layouts`` makes
#: the gradient contiguous on every version (a copy where it was not); this says whether it must.
GROUP_NORM_BACKWARD_NEEDS_CONTIGUOUS_GRAD = TORCH_VERSION < (2, 14)


#: How inductor's generated Python checks an extern kernel's output (a collective's among them), by the
#: function it calls on the buffer right after the call: ``assert_size_stride(buf, size, stride, op)``
#: through torch 2.13, ``assert_tensor_metadata(buf, size, stride, dtype, op)`` from 2.14 on, each then
#: followed by ``assert_alignment(buf, ...)`` (checked on 2.13.0, 2.14.1 and 2.15.0).
#: ``spmd.backend.lowering`` reads the collectives' output sizes from the former and steps over the
#: latter; reading no size, its order check compares only kinds and groups (so a swap of two all-gathers
#: of one group went unseen on 2.14.1 until the second name was added here).
INDUCTOR_OUTPUT_SIZE_CHECKS: tuple[str, ...] = ("assert_size_stride", "assert_tensor_metadata")
INDUCTOR_OUTPUT_OTHER_CHECKS: tuple[str, ...] = ("assert_alignment",)


def register_list_pointwise(op: Any) -> None:
    """Give DTensor a pointwise sharding strategy for ``op``, a list op such as ``_fused_sgd_`` (the
    i-th tensor of every list placed alike): ``_register_single_dim_pointwise`` from torch 2.12 on
    (checked on 2.12.1 and the default versions); torch 2.11 lacks it, and there ``op`` gets
    ``list_pointwise_strategy``, the strategy 2.11 itself registers its fused Adam ops with (checked on
    2.11.0)."""
    if TORCH_VERSION >= (2, 12):
        __getattr__("register_single_dim_pointwise")(op)
        return
    info = __getattr__("RuntimeSchemaInfo")(needs_pytree=True)
    __getattr__("register_op_strategy")(op, schema_info=info)(__getattr__("list_pointwise_strategy"))


def __getattr__(name: str) -> Any:
    """Resolve a lazy entry of :data:`PRIVATE_NAMES` on first use and keep it."""
    entry = PRIVATE_NAMES.get(name)
    if entry is None or name in _EAGER:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = entry.resolve()
    globals()[name] = value
    return value


# --- private attributes of torch objects -------------------------------------------------------------

#: ``dcp.load`` calls this function of ``torch.distributed.checkpoint.state_dict_loader`` on every rank
#: (``spmd.backend.carry`` wraps it to count loads).
DCP_LOAD_STATE_DICT = "_load_state_dict"


def get_compiling_flag() -> bool:
    """``torch.compiler.is_compiling()``'s flag (the value eager code and the optimizers read)."""
    return bool(torch.compiler._is_compiling_flag)


def set_compiling_flag(value: bool) -> None:
    """Set ``torch.compiler``'s private is-compiling flag (see ``spmd.frontend.optim``)."""
    torch.compiler._is_compiling_flag = value


def flatten_mesh(mesh: Any, backend_override: str | None = None) -> Any:
    """``DeviceMesh._flatten()``: one flattened dimension over all of ``mesh``'s dimensions (its group
    made with ``backend_override``, as ``init_device_mesh``'s, where given)."""
    return mesh._flatten(backend_override=backend_override) if backend_override else mesh._flatten()


def global_module_hook_dicts() -> tuple[dict, dict, dict, dict]:
    """The global forward, forward-pre, backward and backward-pre hook dicts of ``nn.Module``."""
    m = torch.nn.modules.module
    return (
        m._global_forward_hooks,
        m._global_forward_pre_hooks,
        m._global_backward_hooks,
        m._global_backward_pre_hooks,
    )


def op_schema(op: Any) -> Any:
    """``OpOverload._schema``: the operator's ``torch._C.FunctionSchema``."""
    return op._schema


def overload_name(op: Any) -> str:
    """``OpOverload._overloadname`` (``"default"``, ``"Tensor"``, ...)."""
    return op._overloadname


def overload_callable(op: Any) -> Any:
    """``OpOverload._op``: the C++ callable that ``op(...)`` calls. ``OpOverload.__call__`` is
    ``return self._op(*args, **kwargs)`` on torch 2.11-2.14; 2.15 first checks for a Python
    dispatcher while torch-function dispatch is being skipped (inside a ``__torch_function__``
    handler), where ``_op`` is still the call it makes otherwise."""
    return op._op


def local_tensor(t: Any) -> Any:
    """``DTensor._local_tensor``: the local shard, without ``to_local()``'s autograd function."""
    return t._local_tensor


def module_parameters(m: torch.nn.Module) -> dict[str, Any]:
    """``nn.Module._parameters``: the module's own parameters (a live dict; ``None`` entries allowed)."""
    return m._parameters  # type: ignore[return-value]


def module_buffers(m: torch.nn.Module) -> dict[str, Any]:
    """``nn.Module._buffers``: the module's own buffers (a live dict)."""
    return m._buffers  # type: ignore[return-value]


def module_children(m: torch.nn.Module) -> dict[str, Any]:
    """``nn.Module._modules``: the module's direct children (a live dict)."""
    return m._modules  # type: ignore[return-value]


def set_module_children(m: torch.nn.Module, children: dict[str, Any]) -> None:
    """Give ``m`` its own ``_modules`` dict (a shallow copy of a module that does not share children)."""
    m._modules = children  # type: ignore[assignment]


def rename_node(node: Any, name: str) -> None:
    """``fx.Node._rename``: rename a node (the graph keeps names unique)."""
    node._rename(name)


def interpreter_current_node(interpreter: Any, node: Any) -> Any:
    """``fx.Interpreter._set_current_node``: the context that makes errors and meta name ``node``."""
    return interpreter._set_current_node(node)


def autograd_sequence_nr(fn: Any) -> int:
    """``autograd.graph.Node._sequence_nr()``: the forward op's sequence number of a backward node."""
    return fn._sequence_nr()


def storage_key(t: torch.Tensor) -> Any:
    """A key identifying ``t``'s storage (``UntypedStorage._cdata``)."""
    return t.untyped_storage()._cdata


def gloo_options(threads: int, timeout: Any, **kwargs: Any) -> Any:
    """``ProcessGroupGloo._Options`` for ``threads`` threads on the default device, with ``timeout``.

    ``kwargs``: the other keywords ``init_process_group`` passes to ``ProcessGroupGloo(store, rank, size,
    timeout=...)``, set on the options by name: none through torch 2.13, ``enable_reconfigure`` from 2.14
    on (checked on 2.13.0 and 2.14.1)."""
    options = torch.distributed.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
    options._threads = threads
    options._devices = [torch.distributed.ProcessGroupGloo.create_default_device()]
    options._timeout = timeout
    for name, value in kwargs.items():
        setattr(options, name, value)
    return options


@contextlib.contextmanager
def gloo_groups_with_threads(threads: int) -> Iterator[None]:
    """Within the block, every gloo process group torch makes (``init_process_group``, ``new_group``,
    ``DeviceMesh``'s groups) runs ``threads`` worker threads.

    ``init_process_group`` and ``new_group`` take no gloo options (torch 2.13 ignores ``pg_options`` for
    gloo), but both construct the class named ``ProcessGroupGloo`` in ``torch.distributed.distributed_c10d``:
    the block swaps that name for a subclass whose constructor sets the thread count (checked on
    2.13.0, 2.14.1 and 2.15.0 by ``tests/unit/test_gloo_threads.py``)."""
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    base = dist.ProcessGroupGloo

    class _GlooWithThreads(base):  # type: ignore[misc, valid-type]
        def __init__(self, store: Any, rank: int, size: int, timeout: Any, **kwargs: Any) -> None:
            super().__init__(store, rank, size, gloo_options(threads, timeout, **kwargs))

    before = c10d.ProcessGroupGloo
    c10d.ProcessGroupGloo = _GlooWithThreads  # type: ignore[misc]
    try:
        yield
    finally:
        c10d.ProcessGroupGloo = before  # type: ignore[misc]


def pg_timeout_s(pg: Any) -> float | None:
    """The collective timeout of ``pg``'s first backend, in seconds (``None`` when it has none)."""
    for device in pg._device_types:
        options = getattr(pg._get_backend(device), "options", None)  # None on a fake group
        return None if options is None else options._timeout.total_seconds()
    return None


def set_pg_timeout(group: Any, seconds: float) -> None:
    """Set ``group``'s collective timeout (``distributed_c10d._set_pg_timeout``, private; present in
    2.11-2.15): for groups torch makes with its 30-minute default (``init_device_mesh``'s)."""
    import datetime

    import torch.distributed.distributed_c10d as c10d

    c10d._set_pg_timeout(datetime.timedelta(seconds=seconds), group)


def gloo_threads(group: Any) -> int:
    """How many threads ``group``'s gloo backend runs (``options._threads``)."""
    return group._get_backend(torch.device("cpu")).options._threads
