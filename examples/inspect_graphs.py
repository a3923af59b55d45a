"""How to read what spmd compiled: the graph stages, node roles and phases, the dump, the report.

    python examples/inspect_graphs.py              # world size 1, a second or two
    python examples/inspect_graphs.py --smoke      # the same (for CI symmetry with the other examples)

Every node of every stage carries, in node.meta, what it holds (passes.meta.ROLE: param, grad,
optim_state, activation, update, comm, ...) and when it runs (passes.meta.PHASE: forward, backward,
optimizer). The tracer records them once; partitioners and passes keep them true, so tools like this
one never guess from node names.
"""

import argparse
import os
from collections import Counter

import torch
import torch.nn as nn
import torch.nn.functional as F

import spmd
from passes.meta import PHASE, ROLE

# ----------------------------------------------------------------------------- settings
p = argparse.ArgumentParser()
p.add_argument("--smoke", action="store_true")  # accepted for symmetry; this script is always small
p.add_argument("--style", default="fully_shard", choices=["fully_shard", "replicate"])  # DataParallel style
args = p.parse_args()
dump_dir = "spmd_dump"  # where the stages are written as Python
width, depth = 64, 2  # a tiny MLP classifier


def tag(value: object) -> str:
    return getattr(value, "value", str(value))  # enum -> its plain string


def main() -> None:
    torch.manual_seed(0)
    layers = [m for _ in range(depth) for m in (nn.Linear(width, width), nn.ReLU())]
    model = nn.Sequential(*layers, nn.Linear(width, 10))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)

    @spmd.compile(parallel_mode=spmd.DataParallel(args.style), dump_dir=dump_dir)
    def train_step(model, optim, x, y):
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        optim.step()
        optim.zero_grad()
        return loss

    loss = train_step(model, optim, torch.randn(16, width), torch.randint(0, 10, (16,)))
    print(f"loss {loss.item():.4f}\n")

    # 1. The stages, in the order they were produced: traced, partitioned, one per pass, final.
    print("stage                     nodes")
    for name, gm in train_step.graphs.items():
        print(f"  {name:<22} {len(gm.graph.nodes):6d}")

    # 2. What the final graph is made of, by phase and role (the tracer files placeholders under forward).
    final = train_step.graphs["final"]
    by = Counter((tag(n.meta.get(PHASE, "-")), tag(n.meta.get(ROLE, "-"))) for n in final.graph.nodes)
    print("\nfinal graph: phase      role          nodes")
    for (phase, role), count in sorted(by.items()):
        print(f"             {phase:<10} {role:<13} {count:5d}")

    # 3. Individual nodes: the optimizer update, and any collectives (none at world size 1).
    updates = {str(n.target) for n in final.graph.nodes if tag(n.meta.get(PHASE)) == "optimizer"}
    print(f"\noptimizer-phase ops: {sorted(updates - {'output'})}")
    comms = [n for n in final.graph.nodes if tag(n.meta.get(ROLE)) == "comm"]
    print(f"collectives and waits: {len(comms)} {[str(n.target) for n in comms][:6]}")

    # 4. The dump: one readable Python file per stage and rank, each line annotated "# phase | role | module".
    where = os.path.join(dump_dir, train_step.__name__, "rank0")
    print(f"\ndump: {where}/")
    for f in sorted(os.listdir(where)):
        print(f"  {f}")
    stages = sorted(f for f in os.listdir(where) if f.endswith(".py"))  # the report sits beside them
    with open(os.path.join(where, stages[-1])) as f:
        lines = [ln.rstrip() for ln in f if "# forward" in ln or "# optimizer" in ln]
    print("  e.g. " + lines[0].strip()[:140])

    # 5. The StepReport (collectives, bytes per rank, predicted peak memory), once the library has it.
    if hasattr(train_step, "report"):
        print(f"\n{train_step.report()}")
    else:
        print("\n(train_step.report() is not available in this version of spmd yet)")


if __name__ == "__main__":
    main()
