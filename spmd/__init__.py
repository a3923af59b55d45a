"""spmd: a whole-train-step SPMD compiler for PyTorch.

@spmd.compile(parallel_mode=spmd.DataParallel("fully_shard"))
def train_step(model, optim, x, y): ...
"""

import logging

from spmd.api import CompiledStep, Override, compile
from spmd.backend.gloo_threads import gloo_threads
from spmd.errors import (
    CacheLimitError,
    CapturedTensorError,
    CollectiveError,
    ConfigError,
    DataCheckError,
    DataDependentControlFlowError,
    HostRandomError,
    InvalidArgumentsError,
    KernelError,
    LoweringError,
    ModelChangedError,
    PassError,
    RankDivergenceError,
    ShardingPropagationError,
    SpmdError,
    StalePrefetchError,
    TraceError,
    UntraceableOpError,
)
from spmd.parallel import DataParallel, DTensorExpandMode, MixedPrecision, ParallelMode
from spmd.parallel.auto_tp import tp_plan_of
from spmd.parallel.offload import CPUOffloadPolicy
from spmd.parallel.sharding import full_state_dict
from spmd.plan import Plan, plan
from spmd.reporting.report import StepReport
from spmd.simulate import simulate

logging.getLogger("spmd").addHandler(logging.NullHandler())

__all__ = [
    "CPUOffloadPolicy",
    "CacheLimitError",
    "CapturedTensorError",
    "CollectiveError",
    "CompiledStep",
    "ConfigError",
    "DataCheckError",
    "DataDependentControlFlowError",
    "DTensorExpandMode",
    "DataParallel",
    "HostRandomError",
    "InvalidArgumentsError",
    "KernelError",
    "LoweringError",
    "MixedPrecision",
    "ModelChangedError",
    "Override",
    "ParallelMode",
    "PassError",
    "Plan",
    "RankDivergenceError",
    "ShardingPropagationError",
    "SpmdError",
    "StalePrefetchError",
    "StepReport",
    "TraceError",
    "UntraceableOpError",
    "compile",
    "full_state_dict",
    "gloo_threads",
    "plan",
    "simulate",
    "tp_plan_of",
]
