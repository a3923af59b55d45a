"""Run a torchrun script's ``main`` so that its process group is destroyed on every exit path.

A gloo rank that leaves the interpreter with its group alive can abort at exit
(pytorch/pytorch#190489; benchmarks/results/crashes.md, "Teardown"), so each benchmark that initialises a
group ends with ``rank_main.run(main)`` (``tests/test_examples.py`` checks that it does).
Imported as a sibling: a script's own directory is first on ``sys.path``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def run(main: Callable[..., Any], *args: Any) -> None:
    """``main(*args)``, then ``destroy_process_group()`` if a group is still initialised."""
    try:
        main(*args)
    finally:
        import torch.distributed

        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
