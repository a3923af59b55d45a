"""passes.async_tp through the whole lowering: one Llama 3.1 70B block (the preset's shapes, one
layer) with torchtitan's sequence-parallel plan, fully_shard x tp 8 on 16 fake ranks, priced on the
H100 profile -- the layout of the 70B plan's best row.

The chunks split each sequence-parallel all-gather and reduce-scatter without changing what is
sent, and the cost model, which sees each chunk's matmul run while the next chunk is in flight,
predicts a fraction of the exposed tensor-parallel communication and a shorter step. The values
are checked on gloo ranks (tests/dist/test_tensor_parallel.py, ``hf_llama_sp`` runs with
``async_tp=2``).
"""

from __future__ import annotations

import collections

import pytest
import torch

import spmd
from passes import collectives as C
from passes.cost_model import estimate_step_time
from spmd import models
from spmd.parallel import MixedPrecision, tp_plans
from spmd.plan import _group_info
from spmd.profiles import get_profile
from spmd.simulate import fake_copy, fake_world, fresh_copy

BLOCK = {**models.PRESETS["llama3.1-70b"], "num_hidden_layers": 1}


def _lower(async_tp: bool | int | str, batch: int):
    model, optim, idx, tgt = models.build_hf(BLOCK, batch=batch, seq=8192)
    mode = spmd.DataParallel(
        "fully_shard",
        tp_size=8,
        tp_plan=tp_plans.llama(sequence_parallel=True),
        mixed_precision=MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
        async_tp=async_tp,
    )
    # The one block stands for one of the 70B's 80: keep it resharded, as every block but the
    # last is (as the last unit of forward it would stay gathered into backward).
    compiled = spmd.compile(
        parallel_mode=mode, check_invariants=True, disabled_passes=["keep_last_unit_gathered"]
    )
    step = fresh_copy(compiled(models.causal_lm_step))
    step._target_accelerator = True
    prof = get_profile("h100-80gb")
    args, kw = fake_copy((model, optim, idx, tgt), {})
    with fake_world(16):
        gm = step.lower(*args, **kw)["final"]
        groups = _group_info(prof.gpus_per_node)
        cost = estimate_step_time(gm, prof, groups)
        tp = {C.group_of(c) for c in C.collectives(gm.graph) if groups(C.group_of(c)).size == 8}
        count: collections.Counter = collections.Counter()
        sent: collections.Counter = collections.Counter()
        for c in C.collectives(gm.graph):
            if C.group_of(c) in tp:
                count[C.kind_of(c).value] += 1
                sent[C.kind_of(c).value] += C.bytes_of(c)
        exposed_tp = sum(cost.exposed_by_group.get(g, 0.0) for g in tp)
        return count, sent, cost, exposed_tp


@pytest.fixture(scope="module")
def lowered():
    return {a: _lower(a, batch=8) for a in (False, "auto")}


def test_chunks_send_the_same_bytes_in_more_collectives(lowered) -> None:
    (n_off, bytes_off, _, _), (n_on, bytes_on, _, _) = lowered[False], lowered["auto"]
    assert bytes_on == bytes_off
    assert n_on["all_gather"] > 2 * n_off["all_gather"]  # every gather before a matmul, in 4 chunks
    assert n_on["reduce_scatter"] > 2 * n_off["reduce_scatter"]


def test_chunks_hide_tensor_parallel_communication_on_paper(lowered) -> None:
    (_, _, off, tp_off), (_, _, on, tp_on) = lowered[False], lowered["auto"]
    assert on.comm_s > off.comm_s  # the same bytes, and each chunk pays the ring's latency
    assert on.compute_s > off.compute_s  # the chunks' results are concatenated back
    assert tp_on < 0.5 * tp_off
    assert on.step_s < off.step_s


def test_one_sequence_per_rank_is_left_alone() -> None:
    """The chunks cut the local batch: with one sequence there is nothing to cut. (Also the
    reshard invariant on a step whose activation gather is read in backward unchunked: the gather
    reads the data, so it is not a parameter's.)"""
    n_on, _, _, _ = _lower("auto", batch=1)
    n_off, _, _, _ = _lower(False, batch=1)
    assert n_on == n_off
