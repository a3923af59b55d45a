"""``passes.layouts.fix_layouts`` on small traced graphs run with inputs laid out otherwise.

Each graph is traced (make_fx, fake) on a contiguous input and then run on a real input of
the same shape and another layout, which is what a kernel returning an unexpected layout
looks like to the ops after it::

    x (traced contiguous, real transposed) -> reader -> ...

A fix-up (``spmd::restride``) must appear exactly where the reader depends on layout.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.fx.experimental.proxy_tensor import make_fx

from passes.layouts import LAYOUT_FIX, RESTRIDE, fix_layouts, restride
from passes.torch_compat import GROUP_NORM_BACKWARD_NEEDS_CONTIGUOUS_GRAD

aten = torch.ops.aten
c10d = torch.ops._c10d_functional


def _trace(f, *shapes):
    return make_fx(f, tracing_mode="fake")(*[torch.randn(*s) for s in shapes])


def _transposed(rows: int, cols: int) -> torch.Tensor:
    """A (rows, cols) tensor with strides (1, rows)."""
    return torch.randn(cols, rows).t()


def _restrides(gm) -> list:
    return [n for n in gm.graph.nodes if n.target is RESTRIDE]


def test_nothing_to_fix_leaves_the_graph_untouched() -> None:
    gm = _trace(lambda x: aten.view(x, [24]) * 2, (4, 6))
    code = gm.code
    x = torch.randn(4, 6)
    same, out, fixes = fix_layouts(gm, [x])
    assert same is gm and fixes == [] and gm.code == code
    assert torch.equal(out, x.view(24) * 2)


def test_view_of_a_transposed_input_gets_a_copy_into_the_traced_layout() -> None:
    gm = _trace(lambda x: aten.view(x, [24]) * 2, (4, 6))
    x = _transposed(4, 6)
    with pytest.raises(RuntimeError, match="view size is not compatible"):
        gm(x)
    same, out, fixes = fix_layouts(gm, [x])
    assert same is gm and len(fixes) == 1 and fixes[0].meta[LAYOUT_FIX]
    want = x.reshape(24) * 2
    assert torch.equal(out, want)
    assert torch.equal(gm(x), want)  # the recompiled graph runs on
    (fix,) = _restrides(gm)
    assert fix.args[1:] == ([4, 6], [6, 1], 0)


def test_a_view_that_works_on_the_real_layout_is_left_alone() -> None:
    gm = _trace(lambda x: aten.view(x, [4, 3, 2]) + 1, (4, 6))
    x = torch.randn(4, 12)[:, :6]  # strides (12, 1): splitting the last dim is still a view
    _, out, fixes = fix_layouts(gm, [x])
    assert fixes == [] and torch.equal(out, x.reshape(4, 3, 2) + 1)


def test_pointwise_and_reductions_read_any_layout() -> None:
    gm = _trace(lambda x: (x.exp() * 3).sum(0), (4, 6))
    x = _transposed(4, 6)
    _, out, fixes = fix_layouts(gm, [x])
    assert fixes == [] and torch.equal(out, (x.exp() * 3).sum(0))


def test_an_unknown_op_gets_its_input_in_the_traced_layout() -> None:
    gm = _trace(lambda x: aten.cumsum(x, 1) + aten.cumsum(x, 0), (4, 6))
    x = _transposed(4, 6)
    _, out, fixes = fix_layouts(gm, [x])
    assert len(fixes) == 1, "both readers share one copy of x"
    xc = x.contiguous()
    assert torch.equal(out, aten.cumsum(xc, 1) + aten.cumsum(xc, 0))
    assert len(_restrides(gm)) == 1


def test_as_strided_reads_the_traced_layout() -> None:
    gm = _trace(lambda x: aten.as_strided(x, [3, 4], [4, 1], 2) * 1, (4, 6))
    x = _transposed(4, 6)
    _, out, fixes = fix_layouts(gm, [x])
    assert len(fixes) == 1
    assert torch.equal(out, x.contiguous().as_strided([3, 4], [4, 1], 2))


def test_a_mismatched_tensor_written_in_place_is_written_through_a_copy() -> None:
    def f(x):
        y = x * 1
        aten.cumsum_(y, 1)  # an in-place, layout-sensitive write
        return y + 1, aten.cumsum(y, 0)

    gm = _trace(f, (4, 6))
    # The real product keeps x's transposed layout; the trace assumed contiguous.
    x = _transposed(4, 6)
    _, out, fixes = fix_layouts(gm, [x])
    y = (x * 1).contiguous()
    aten.cumsum_(y, 1)
    want = (y + 1, aten.cumsum(y, 0))
    assert all(torch.equal(a, b) for a, b in zip(out, want))
    # (later reads go through cumsum_'s result, the copy, which has the traced layout)
    assert [f.target for f in fixes] == [RESTRIDE, aten.copy_.default]
    assert all(torch.equal(a, b) for a, b in zip(gm(x), want))


def test_collective_inputs_are_fixed(world) -> None:
    group = dist.group.WORLD.group_name

    def f(x):
        return c10d.wait_tensor(c10d.all_reduce(x * 2, "sum", group))

    gm = _trace(f, (4, 6))
    x = _transposed(4, 6)
    _, out, fixes = fix_layouts(gm, [x])
    assert len(fixes) == 1 and fixes[0].next.target is c10d.all_reduce.default
    if world.real:
        assert torch.equal(out, x * 2 * world.size)


def test_restride_keeps_size_stride_and_offset() -> None:
    x = _transposed(4, 6)
    y = restride(x, [4, 6], [7, 1], 3)
    assert y.stride() == (7, 1) and y.storage_offset() == 3 and torch.equal(y, x)
    assert restride(torch.empty(0, 3), [0, 3], [3, 1], 0).shape == (0, 3)


def test_group_norm_backward_gets_the_contiguous_grad_its_trace_assumed() -> None:
    """native_group_norm_backward computes silently wrong values on a non-contiguous grad
    (eager's autograd formula calls .contiguous(), which the trace drops on a contiguous fake)
    through torch 2.13; from 2.14 the kernel reads it right, and the fix still gives eager's bits."""
    n, c, t, groups = 4, 8, 6, 2
    x, w, b = torch.randn(n, c, t), torch.randn(c), torch.randn(c)
    _, mean, rstd = aten.native_group_norm(x, w, b, n, c, t, groups, 1e-5)

    def f(g, x, mean, rstd, w):
        return aten.native_group_norm_backward(g * 1, x, mean, rstd, w, n, c, t, groups, [True, True, True])

    gm = make_fx(f, tracing_mode="fake")(torch.randn(n, c, t), x, mean, rstd, w)
    g = torch.randn(n, t, c).transpose(1, 2)  # the layout a transposing model hands back
    want = f(g.contiguous(), x, mean, rstd, w)
    wrong = not torch.allclose(gm(g, x, mean, rstd, w)[0], want[0])
    assert wrong is GROUP_NORM_BACKWARD_NEEDS_CONTIGUOUS_GRAD, "passes.torch_compat's flag is out of date"
    _, out, fixes = fix_layouts(gm, [g, x, mean, rstd, w])
    assert len(fixes) == 1
    for got, exp in zip(out, want):
        assert torch.equal(got, exp)


def test_a_copy_is_not_shared_across_an_in_place_write() -> None:
    def f(x, buf):
        a = aten.cumsum(x, 1)
        aten.copy_(buf, a)  # a write between the two readers of x
        return a + aten.cumsum(x, 0) + buf

    gm = _trace(f, (4, 6), (4, 6))
    x, buf = _transposed(4, 6), torch.zeros(4, 6)
    _, out, fixes = fix_layouts(gm, [x, buf.clone()])
    assert len(fixes) == 2
    xc = x.contiguous()
    a = aten.cumsum(xc, 1)
    assert torch.equal(out, a + aten.cumsum(xc, 0) + a)


def test_a_second_check_after_a_failed_run_adds_nothing_twice() -> None:
    def f(x, y):
        return aten.cumsum(x, 1).sum() + aten.mm(aten.view(x, [6, 4]), y).sum()

    gm = _trace(f, (4, 6), (4, 3))
    x = _transposed(4, 6)
    # mm's shapes do not fit: the run raises after the fix-up (shared by cumsum and view)
    with pytest.raises(RuntimeError):
        fix_layouts(gm, [x, torch.randn(5, 3)])
    assert len(_restrides(gm)) == 1
    y = torch.randn(4, 3)
    _, out, fixes = fix_layouts(gm, [x, y])
    assert fixes == [] and len(_restrides(gm)) == 1
    xc = x.contiguous()
    assert torch.equal(out, aten.cumsum(xc, 1).sum() + aten.mm(xc.view(6, 4), y).sum())


def test_an_input_written_in_place_through_a_copy_is_updated() -> None:
    """The caller's tensor (a buffer, say) sees the write: the copy goes back into it."""

    def f(buf):
        aten.cumsum_(buf, 1)
        return buf * 2

    gm = _trace(f, (4, 6))
    buf = _transposed(4, 6)
    want = aten.cumsum(buf.contiguous(), 1)
    _, out, fixes = fix_layouts(gm, [buf])
    assert len(fixes) == 2
    assert torch.equal(buf, want) and torch.equal(out, want * 2)
    buf2 = _transposed(4, 6)
    want2 = aten.cumsum(buf2.contiguous(), 1)
    gm(buf2)  # the fixed graph does the same on later runs
    assert torch.equal(buf2, want2)


@pytest.mark.parametrize(
    "draw",
    [
        lambda x: torch.empty_like(x).bernoulli_(0.5),  # nn.Dropout's mask
        lambda x: torch.rand_like(x),
        lambda x: torch.empty_like(x).uniform_(),
        lambda x: torch.bernoulli(x.sigmoid()),
    ],
)
def test_random_fills_draw_on_the_real_layout(draw) -> None:
    """A random op fills memory in order: on the real (eager's) layout each element gets eager's
    draw. A copy into the traced layout would put the same draws on other elements."""
    gm = _trace(lambda x: draw(x) * x, (4, 6))
    x = _transposed(4, 6)
    torch.manual_seed(0)
    _, out, fixes = fix_layouts(gm, [x])
    torch.manual_seed(0)
    want = draw(x) * x
    assert fixes == [] and torch.equal(out, want)
