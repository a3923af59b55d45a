"""Peak memory of one cached step, backend="eager" against backend="inductor" (world size 1).

    MALLOC_MMAP_THRESHOLD_=65536 OMP_NUM_THREADS=1 python benchmarks/profiles/backend_memory.py eager
    MALLOC_MMAP_THRESHOLD_=65536 OMP_NUM_THREADS=1 python benchmarks/profiles/backend_memory.py inductor

inductor's buffers bypass both MemTracker and the profiler's allocation events, so this reads the
process's resident set: the high-water mark is reset (``/proc/self/clear_refs`` 5), one step runs,
and the peak above the resident set before it is printed. The fixed mmap threshold makes glibc
return freed tensors to the OS at once, so the resident set follows the live tensors. A
parameter-sized copy per step (a functionalized optimizer) would show as +params.
"""

import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, __file__.rsplit("/", 3)[0])
import spmd  # noqa: E402

# ----------------------------------------------------------------------------- settings
backend = sys.argv[1] if len(sys.argv) > 1 else "eager"
d, layers, batch = 1024, 8, 8  # 8 x 1024x1024 Linear: ~32 MiB of parameters, small activations


def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key))


def step_peak(run) -> int:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM to the current resident set
    base = _status("VmRSS:")
    run()
    return _status("VmHWM:") - base


def train_step(model, opt, x, y):
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss


torch.manual_seed(0)
model = nn.Sequential(*[nn.Sequential(nn.Linear(d, d), nn.ReLU()) for _ in range(layers)], nn.Linear(d, 16))
opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
step = spmd.compile(backend=backend)(train_step)
x, y = torch.randn(batch, d), torch.randint(16, (batch,))
for _ in range(2):  # compile, then one cached step
    step(model, opt, x, y)
params = sum(p.numel() * p.element_size() for p in model.parameters())
peaks = [step_peak(lambda: step(model, opt, x, y)) for _ in range(3)]
print(
    f"{backend}: parameters {params / 2**20:.1f} MiB; step peak above the state {min(peaks) / 2**20:.2f} MiB"
)
