"""passes.invariants.INPUT_HELD holds on the installed torch: every collective listed there
keeps its input alive until the wait (its work object holds it) or copies it at the issue.

The collective-buffer invariant lets the eager runtime drop the graph's last reference to a
collective's input right after the issue only for these ops; were one to stop holding it
(a torch upgrade), the runtime would free a buffer gloo's thread still reads.
"""

from __future__ import annotations

import pytest

from benchmarks.diagnostics.collective_refs import probe
from passes.invariants import INPUT_HELD


@pytest.mark.timeout(300)
def test_every_op_the_invariant_trusts_keeps_its_input(monkeypatch) -> None:
    # Freed memory is overwritten at once in the ranks (glibc), so a freed input shows as garbage.
    monkeypatch.setenv("MALLOC_PERTURB_", "165")
    found = probe(late_s=0.5)
    assert set(found) == {op._schema.name.split("::")[1] for op in INPUT_HELD}
    wrong = [name for name, (_, right) in found.items() if not right]
    assert not wrong, f"collectives whose input was freed before the wait: {wrong}"
    # The ones that read their input after the issue hold it (the others copy it at the issue).
    for name in (
        "all_reduce_",
        "all_gather_into_tensor",
        "all_to_all_single",
        "all_gather_into_tensor_coalesced",
    ):
        assert found[name][0] >= 1, (name, found[name])
