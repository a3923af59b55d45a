"""Parallel modes: how a traced single-device step becomes an SPMD step."""

from spmd.parallel.base import ParallelMode
from spmd.parallel.data_parallel import DataParallel

__all__ = ["DataParallel", "ParallelMode"]
