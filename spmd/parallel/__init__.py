"""Parallel modes: how a traced single-device step becomes an SPMD step."""

from spmd.parallel.base import ParallelMode
from spmd.parallel.data_parallel import DataParallel
from spmd.parallel.expand import DTensorExpandMode
from spmd.parallel.mixed_precision import MixedPrecision

__all__ = ["DTensorExpandMode", "DataParallel", "MixedPrecision", "ParallelMode"]
