"""Level 8's tensors as storage, shape and strides (level8_framework/strides.py): the layout functions against
PyTorch's own layouts, and the views on each backend - transpose, permute, slicing, broadcasting, reshape - against the
same views in PyTorch: shape, strides, offset, values, and whether the storage is shared (a view) or not (a copy).

Layouts are integers and views copy values without arithmetic: everything here is compared exactly. The gradients
through views are checked against torch.autograd in tests/test_operators.py.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from level8_framework import strides
from strided_stand_in import device  # noqa: F401 (a fixture: cpu, cuda, cuda over a stand-in)

pytestmark = pytest.mark.level8


def layouts():
    """(name, a PyTorch view of arange(24) as (2, 3, 4)): contiguous, transposed, sliced, stretched, and mixtures."""
    base = torch.arange(24.0).reshape(2, 3, 4)
    return [("contiguous", base), ("transposed", base.transpose(0, 2)), ("permuted", base.permute(1, 2, 0)),
            ("sliced", base[:, 1:, ::2]), ("a row", base[1]), ("stretched", base[:, :1].expand(2, 3, 4)),
            ("a column", base[:, :, 1:2]), ("a slice of a permute", base.permute(2, 0, 1)[1:3])]


def same_size_shapes(size: int) -> list[tuple[int, ...]]:
    """Every shape of 1 to 3 axes holding `size` values, axes of size 1 included."""
    divisors = [d for d in range(1, size + 1) if size % d == 0]
    shapes = {(size,)}
    for a in divisors:
        shapes.add((a, size // a))
        shapes |= {(a, b, size // a // b) for b in divisors if (size // a) % b == 0}
    return sorted(shapes)


# ---- the layout functions against PyTorch's ----


@pytest.mark.parametrize("shape", [(), (5,), (2, 3, 4), (3, 1, 2), (1, 4), (2, 0, 3)])
def test_contiguous_strides_are_pytorchs(shape):
    assert strides.contiguous_strides(shape) == torch.empty(shape).stride()


@pytest.mark.parametrize("name, t", layouts(), ids=[name.replace(" ", "-") for name, _ in layouts()])
def test_is_contiguous_and_index_to_position_read_pytorchs_layouts(name, t):
    """Every value of the view lies where index_to_position says, in its storage."""
    storage = torch.arange(24.0)
    assert strides.is_contiguous(tuple(t.shape), t.stride()) == t.is_contiguous()
    for index in itertools.product(*map(range, t.shape)):
        assert storage[strides.index_to_position(index, t.stride(), t.storage_offset())] == t[index]


@pytest.mark.parametrize("name, t", layouts(), ids=[name.replace(" ", "-") for name, _ in layouts()])
def test_view_strides_are_pytorchs_computestride(name, t):
    """For every shape of the same size: PyTorch's view() succeeds exactly where view_strides finds strides, and
    with the same strides; elsewhere view() raises and only reshape() (a copy) can."""
    for shape in same_size_shapes(t.numel()):
        ours = strides.view_strides(tuple(t.shape), t.stride(), shape)
        try:
            theirs = t.view(shape).stride()
        except RuntimeError:
            theirs = None
        assert ours == theirs, f"{name} {tuple(t.shape)} {t.stride()} -> {shape}"


@pytest.mark.parametrize("key", [1, -1, (0, 1), slice(1, None), (slice(None), slice(None, None, 2)),
                                 (3, slice(0, 2, 2), 2), (slice(2, 9),), (slice(None), 1), (np.int64(2), -2)],
                         ids=lambda k: str(k).replace(" ", ""))
def test_index_is_pytorchs_basic_indexing(key):
    t = torch.arange(24.0).reshape(2, 3, 4).permute(2, 0, 1)  # (4, 2, 3), strides (1, 12, 4)
    shape, view_strides, offset = strides.index(tuple(t.shape), t.stride(), key)
    picked = t[key]
    assert (shape, view_strides, offset) == (tuple(picked.shape), picked.stride(), picked.storage_offset())


@pytest.mark.parametrize("shape, target", [((3,), (2, 3)), ((2, 1), (2, 5)), ((1, 3, 1), (4, 1, 3, 2)), ((), (2, 2))])
def test_broadcast_strides_are_pytorchs_expand(shape, target):
    t = torch.zeros(shape)
    assert strides.broadcast_strides(shape, t.stride(), target) == t.expand(target).stride()


def test_layouts_refuse_what_they_cannot_be():
    with pytest.raises(ValueError, match="broadcast"):
        strides.broadcast_strides((3,), (1,), (2, 4))
    with pytest.raises(ValueError, match="each of the 2 axes once"):
        strides.permute((2, 3), (3, 1), (0, 0))
    with pytest.raises(ValueError, match="positive"):
        strides.index((4,), (1,), slice(None, None, -1))
    with pytest.raises(IndexError, match="out of range"):
        strides.index((4,), (1,), 4)
    with pytest.raises(IndexError, match="too many"):
        strides.index((4,), (1,), (0, 0))
    with pytest.raises(TypeError, match="ints and slices"):
        strides.index((4,), (1,), 1.5)
    with pytest.raises(ValueError, match="cannot reshape"):
        strides.infer_shape(12, (5, -1))
    assert strides.infer_shape(12, (2, -1, 3)) == (2, 2, 3)


# ---- views on each backend, against the same views in PyTorch ----

VIEWS = {
    "transpose": lambda t: t.transpose(0, 2),
    "permute": lambda t: t.permute(2, 0, 1),
    ".T of a matrix": lambda t: t.reshape(6, 4).T,
    "slices with steps": lambda t: t[1:, ::2, 1:4:2],
    "ints": lambda t: t[1, :, 2],
    "a negative int": lambda t: t[-1],
    "a slice of a transpose": lambda t: t.transpose(0, 2)[::3, 1:],
    "expand (stride 0)": lambda t: t[:, :1].expand(5, 2, 3, 4),
    "reshape, a view": lambda t: t.reshape(2, 12),
    "reshape of a slice, a view": lambda t: t[:, 1:].reshape(2, 8),
    "reshape of a permute, a copy": lambda t: t.permute(2, 0, 1).reshape(4, 6),
    "reshape of a transpose, a view": lambda t: t.transpose(0, 1).reshape(3, 2, 2, 2),
    "flatten": lambda t: t.permute(0, 2, 1).flatten(1),
    "contiguous of a transpose": lambda t: t.transpose(1, 2).contiguous(),
    "contiguous of a contiguous": lambda t: t.contiguous(),
}


def shares_storage(view, base) -> bool:
    """Whether two tensors of level 8 lie in one storage (NumPy memory, or one device allocation)."""
    if view.device == "cpu":
        return np.shares_memory(view.data, base.data)
    return view.data.memory is base.data.memory


@pytest.mark.parametrize("name", VIEWS, ids=lambda name: name.replace(" ", "-").replace(",", ""))
def test_views_are_pytorchs_over_the_same_storage(device, name):
    """The view's shape, strides and offset are PyTorch's, and so are its values; it shares the storage exactly where
    PyTorch's does (reshape copies only where no strides can read the values in the new shape)."""
    import level8_framework as fw

    values = np.arange(24, dtype=np.float32).reshape(2, 3, 4)
    base, theirs_base = fw.Tensor(values, device=device), torch.from_numpy(values)
    ours, theirs = VIEWS[name](base), VIEWS[name](theirs_base)
    assert (ours.shape, ours.stride(), ours.storage_offset()) == (tuple(theirs.shape), theirs.stride(),
                                                                   theirs.storage_offset())
    np.testing.assert_array_equal(ours.numpy(), theirs.numpy())
    is_view = theirs.untyped_storage().data_ptr() == theirs_base.untyped_storage().data_ptr()
    assert shares_storage(ours, base) == is_view
    assert ours.is_contiguous() == theirs.is_contiguous()
    if is_view:  # each value where index_to_position finds it in the base's storage
        storage = values.ravel()
        for index in itertools.product(*map(range, ours.shape)):
            assert storage[strides.index_to_position(index, ours.stride(), ours.storage_offset())] == theirs[index]


def test_a_view_sees_a_change_to_its_storage():
    """On the CPU a tensor from_numpy and its views share the array's memory (no copy at any step)."""
    import level8_framework as fw

    values = np.arange(12, dtype=np.float32).reshape(3, 4)
    view = fw.from_numpy(values).T[1:, ::2]
    values[0, 1] = 100.0
    assert view.numpy()[0, 0] == 100.0 and view.storage_offset() == 1


def test_view_refuses_what_only_a_copy_can_do(device):
    import level8_framework as fw

    t = fw.Tensor(np.arange(6, dtype=np.float32).reshape(2, 3), device=device)
    with pytest.raises(RuntimeError, match="reshape"):
        t.T.view(6)
    assert t.T.reshape(6).is_contiguous() and not shares_storage(t.T.reshape(6), t)
    assert shares_storage(t.view(3, 2), t)


def test_a_view_never_reaches_outside_its_storage(device):
    """A wrong stride raises instead of reading values another tensor owns."""
    import level8_framework as fw

    t = fw.Tensor(np.arange(6, dtype=np.float32), device=device)
    with pytest.raises(ValueError):
        t.backend.as_strided(t.data, (3,), (3,), 0)
    with pytest.raises(ValueError):
        t.backend.as_strided(t.data, (2,), (1,), 5)
    assert t.backend.as_strided(t.data, (2,), (5,), 0) is not None  # positions 0 and 5: inside


def test_the_gpus_strided_copy_has_at_most_eight_axes(device):
    """ops.cu's strided copy passes the layout by value, OPS_MAX_DIMS = 8 axes: a ninth is refused in Python with the
    reason, never sent to the kernel; NumPy takes it."""
    import level8_framework as fw

    t = fw.Tensor(np.zeros((1,) * 8 + (2,), np.float32), device=device).permute(8, *range(8)).expand(*(2,) * 9)
    if device == "cpu":
        assert t.contiguous().shape == (2,) * 9
        return
    with pytest.raises(NotImplementedError, match="at most 8 axes"):
        t.contiguous()


def test_the_chapters_figure_reads_each_view_through_its_layout():
    """Chapter 8's figure of views (common/book/figures/level8.py): under each view's label, its grid shows row by row
    the storage's values at index_to_position, and the storage cells it reads carry their place in that order (a
    stride of 0 reads a cell twice: two numbers)."""
    import matplotlib

    matplotlib.use("Agg")
    from common.book.figures import level8 as figures

    storage = np.arange(100, 112, dtype=np.float32)  # values unlike their positions
    layouts = [("x.T", (4, 3), (1, 4), 0), ("x[1:, ::2]", (2, 2), (4, 2), 4), ("a broadcast", (2, 3), (0, 4), 1)]
    shown = [text.get_text() for text in figures.views(storage, layouts, "test").axes[0].texts]
    for label, shape, view_strides, offset in layouts:
        start = shown.index(f"{label}: shape {shape}, strides {view_strides}, offset {offset}") + 1
        values = [f"{storage[strides.index_to_position(i, view_strides, offset)]:g}" for i in np.ndindex(*shape)]
        assert shown[start : start + len(values)] == values, label
    assert {"1,4", "2,5", "3,6"} <= set(shown)
