"""Generate text from the GPT that examples/train_gpt.py trained (one process, no torchrun).

    torchrun --standalone --nproc_per_node=2 examples/train_gpt.py     # writes checkpoints/
    python examples/sample.py --prompt "def " --chars 400

A checkpoint written under torchrun is a torch.distributed.checkpoint (DCP) directory, one file per
rank; DCP reads it back here without a process group and reassembles the full tensors, whether the
parameters were sharded (fully_shard) or replicated. Under plain python the trainer writes model.pt.
"""

import argparse
import os
import warnings

import torch
import torch.distributed.checkpoint as dcp
from gpt import GPT

# ----------------------------------------------------------------------------- settings
p = argparse.ArgumentParser()
p.add_argument("--ckpt", default="checkpoints")  # the trainer's checkpoint directory
p.add_argument("--prompt", default="def ")  # text to continue
p.add_argument("--chars", type=int, default=300)  # characters to generate
p.add_argument("--temperature", type=float, default=0.8)  # < 1: more conservative, > 1: more random
p.add_argument("--seed", type=int, default=0)  # sampling seed
args = p.parse_args()


def newest_exists(*paths: str) -> str | None:
    found = [q for q in paths if os.path.exists(q)]
    return max(found, key=os.path.getmtime) if found else None


def main() -> None:
    meta = torch.load(os.path.join(args.ckpt, "meta.pt"))
    chars = meta.pop("chars")
    model = GPT(len(chars), **meta)
    where = newest_exists(os.path.join(args.ckpt, ".metadata"), os.path.join(args.ckpt, "model.pt"))
    if where is None:
        raise SystemExit(f"no checkpoint in {args.ckpt}/: run examples/train_gpt.py first")
    if where.endswith("model.pt"):
        model.load_state_dict(torch.load(where)["model"])
    else:
        state = {"model": model.state_dict()}
        with warnings.catch_warnings():  # DCP warns that it is loading without a process group: intended
            warnings.simplefilter("ignore", UserWarning)
            dcp.load(state, checkpoint_id=args.ckpt, no_dist=True)  # in place; only the keys asked for
        model.load_state_dict(state["model"])
    model.eval()

    lut = {c: i for i, c in enumerate(chars)}
    idx = torch.tensor([[lut.get(c, lut.get("?", 0)) for c in args.prompt]], dtype=torch.long)
    torch.manual_seed(args.seed)
    with torch.no_grad():
        for _ in range(args.chars):
            logits = model(idx[:, -meta["block"] :])[:, -1] / args.temperature
            idx = torch.cat([idx, torch.multinomial(logits.softmax(-1), 1)], dim=1)
    print("".join(chars[i] for i in idx[0].tolist()))


if __name__ == "__main__":
    main()
