"""Every example runs end to end in its smoke mode, as a user would launch it.

Each script runs as a subprocess in a temporary working directory (the examples write
spmd_dump/ and checkpoints/ relative to it, so nothing lands in the repository), with
OMP_NUM_THREADS=1 and a hard deadline that kills the whole process group (torchrun and
its ranks). The asserts check the exit code and the lines a user would look for.
37 s in all on 2 shared cores (load ~3), most of it process start-up and tracing.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.dist.launcher import torchrun_crash

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
DEADLINE_S = 150  # per script; generous because CI machines are shared (idle: 2-15 s each)
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]


def run_example(args: list[str], cwd: Path) -> str:
    """Run one command to completion in ``cwd``; returns stdout+stderr, fails on error or deadline.
    A worker that crashed natively (SIGABRT/SIGSEGV, even at exit after its work was done)
    fails, never retried, with the signal named and the output (faulthandler's stacks)."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", PYTHONFAULTHANDLER="1")
    env.pop("SPMD_DUMP_DIR", None)
    root = str(EXAMPLES.parent)  # spmd and passes importable without an install, too
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    proc = subprocess.Popen(
        args,
        cwd=cwd,
        env=env,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,  # one process group: a deadline kills torchrun's ranks as well
    )
    try:
        out, _ = proc.communicate(timeout=DEADLINE_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"{' '.join(map(str, args))} ran past {DEADLINE_S} s:\n{out[-4000:]}")
    crash = torchrun_crash(out)
    assert crash is None, f"{' '.join(map(str, args))}: native crash ({crash}), not retried:\n{out[-8000:]}"
    assert proc.returncode == 0, f"{' '.join(map(str, args))} exited {proc.returncode}:\n{out[-4000:]}"
    return out


@pytest.fixture(scope="module")
def gpt_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """examples/train_gpt.py --smoke on 2 ranks; its checkpoint feeds the sample test."""
    cwd = tmp_path_factory.mktemp("train_gpt")
    return cwd, run_example([*TORCHRUN, str(EXAMPLES / "train_gpt.py"), "--smoke"], cwd)


@pytest.mark.timeout(DEADLINE_S + 30)
def test_train_gpt_smoke_on_two_ranks(gpt_run):
    cwd, out = gpt_run
    assert "world 2, fully_shard" in out
    assert re.search(r"step 4: val loss \d+\.\d+", out), out[-2000:]
    assert "checkpoint saved to checkpoints/smoke/" in out
    assert (cwd / "checkpoints" / "smoke" / ".metadata").exists()  # a DCP checkpoint, one file per rank
    for rank in (0, 1):
        stages = sorted(p.name for p in (cwd / "spmd_dump" / "train_step" / f"rank{rank}").glob("*.py"))
        assert stages[0] == "00_traced.py" and stages[-1].endswith("_final.py"), stages


@pytest.mark.timeout(DEADLINE_S + 30)
def test_sample_from_the_smoke_checkpoint(gpt_run):
    cwd, _ = gpt_run
    args = ["--ckpt", "checkpoints/smoke", "--prompt", "def ", "--chars", "40"]
    out = run_example([sys.executable, str(EXAMPLES / "sample.py"), *args], cwd)
    assert out.startswith("def ") and len(out.rstrip("\n")) >= 44, out


@pytest.mark.timeout(DEADLINE_S + 30)
def test_inspect_graphs(tmp_path):
    out = run_example([sys.executable, str(EXAMPLES / "inspect_graphs.py"), "--smoke"], tmp_path)
    for stage in ("traced", "partitioned", "final"):
        assert re.search(rf"^\s+{stage}\s+\d+$", out, re.M), f"no stage {stage!r}:\n{out}"
    assert "optimizer-phase ops:" in out and "_fused_adamw_" in out
    assert "# forward |" in out  # an annotated line of the dump
    assert (tmp_path / "spmd_dump" / "train_step" / "rank0").is_dir()


@pytest.mark.timeout(DEADLINE_S + 30)
def test_override_moe(tmp_path):
    out = run_example([sys.executable, str(EXAMPLES / "override_moe.py"), "--smoke"], tmp_path)
    assert "check: DenseMoE == routed MoE" in out
    assert "without an Override: UntraceableOpError" in out  # the routed MoE alone cannot be compiled
    m = re.search(r"final: loss (\d+\.\d+) -> (\d+\.\d+) in \d+ steps; 1 graph\(s\)", out)
    assert m, out
    assert float(m[2]) < float(m[1]), "the loss should fall"


@pytest.mark.timeout(DEADLINE_S + 30)
def test_train_gpt_tp_smoke_on_four_ranks(tmp_path):
    """examples/train_gpt_tp.py --smoke: fully_shard x TP 2 on a 2 x 2 mesh of gloo ranks, the
    placements chosen by spmd (the MLP's column -> row pair)."""
    args = [*TORCHRUN[:-1], "--nproc_per_node=4", str(EXAMPLES / "train_gpt_tp.py"), "--smoke"]
    out = run_example(args, tmp_path)
    assert "2 data ranks x 2 tensor-parallel ranks (fully_shard)" in out
    m = re.search(r"loss (\d+\.\d+) -> (\d+\.\d+); blocks.0.fc.weight \(128, 32\) is \(_StridedShard", out)
    assert m, out
    assert float(m[2]) < float(m[1]), "the loss should fall"
    assert "local (32, 32)" in out  # 128 rows / 2 tp ranks / 2 data ranks
    assert "tensor-parallel placements (chosen by spmd)" in out and "'blocks.*.fc': 'ColwiseParallel'" in out


def test_every_torchrun_script_destroys_its_group_on_every_exit_path() -> None:
    """A gloo rank that leaves the interpreter with its process group alive can abort at exit:
    gloo's worker thread drops a finished collective's tensor while the interpreter finalizes,
    takes the GIL to free its Python object, and is ended mid-destructor ("terminate called
    without an active exception", SIGABRT; pytorch/pytorch#190489). Reproduced 2026-11-25 by
    ``MODE=teardown CASE=unwaited benchmarks/diagnostics/crash_hunt.sh``
    (benchmarks/results/crashes.md, "Teardown").
    So every script of the examples, the multi-process tests and the benchmarks that calls
    ``init_process_group`` destroys the group in a ``finally:``, an error's path included
    (``tests/dist/launcher.py``'s ranks do; ``tests/dist/resume_script.py``'s surviving rank
    leaves by an error). A benchmark may end with ``rank_main.run(main)`` instead, which does it."""
    import ast

    def destroys_in_finally(tree: ast.AST) -> bool:
        return any(
            isinstance(c, ast.Call) and getattr(c.func, "attr", None) == "destroy_process_group"
            for t in ast.walk(tree)
            if isinstance(t, ast.Try)
            for stmt in t.finalbody
            for c in ast.walk(stmt)
        )

    def runs_through_rank_main(tree: ast.AST) -> bool:
        return any(
            isinstance(c, ast.Call)
            and isinstance(c.func, ast.Attribute)
            and c.func.attr == "run"
            and getattr(c.func.value, "id", None) == "rank_main"
            for c in ast.walk(tree)
        )

    root = EXAMPLES.parent
    assert destroys_in_finally(ast.parse((root / "benchmarks" / "rank_main.py").read_text()))
    missing = []
    scripts = [*root.glob("examples/*.py"), *root.glob("tests/dist/*.py"), *root.glob("benchmarks/**/*.py")]
    for path in sorted(scripts):
        rel = path.relative_to(root).as_posix()
        tree = ast.parse(path.read_text())
        calls = {
            n.func.attr if isinstance(n.func, ast.Attribute) else getattr(n.func, "id", "")
            for n in ast.walk(tree)
            if isinstance(n, ast.Call)
        }
        if "init_process_group" not in calls:
            continue
        through_helper = rel.startswith("benchmarks/") and runs_through_rank_main(tree)
        if not (destroys_in_finally(tree) or through_helper):
            missing.append(rel)
    assert not missing, f"init_process_group without destroy_process_group in a finally: {missing}"


def test_train_gpt_cuda_path_up_to_the_device(monkeypatch) -> None:
    """``--device cuda`` on a machine without a GPU: examples/gpt.py's ``init_device`` (what
    train_gpt.py calls first) with CUDA faked picks the GPU of ``LOCAL_RANK``, sets it before
    anything else and asks for an NCCL group bound to it; with no CUDA it stops with a clear message."""
    import importlib.util

    import torch

    spec = importlib.util.spec_from_file_location("gpt_example", EXAMPLES / "gpt.py")
    gpt = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpt)
    assert gpt.init_device("cpu") == (torch.device("cpu"), {"backend": "gloo"})
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match="sees no CUDA device"):
        gpt.init_device("cuda")
    calls = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_device", calls.append)
    monkeypatch.setenv("LOCAL_RANK", "3")
    device, group = gpt.init_device("cuda")
    assert device == torch.device("cuda", 3) and calls == [device]
    assert group == {"backend": "nccl", "device_id": device}
    src = (EXAMPLES / "train_gpt.py").read_text()  # the example puts the model and each batch there
    assert "init_process_group(**group)" in src and ".to(device)" in src and ".to(device, non_blocking" in src


@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs a CUDA device (none here)")
@pytest.mark.timeout(DEADLINE_S + 30)
def test_train_gpt_smoke_on_cuda(tmp_path):
    """The GPU path end to end on one GPU (NCCL, world size 1, bf16): runs only where a GPU is."""
    args = [*TORCHRUN[:-1], "--nproc_per_node=1", str(EXAMPLES / "train_gpt.py"), "--smoke"]
    out = run_example([*args, "--device", "cuda", "--mixed-precision", "bf16"], tmp_path)
    assert "world 1, fully_shard/eager, cuda" in out and re.search(r"step 4: val loss \d+\.\d+", out), out
