"""Level 8's tensors as storage, shape and strides: the small pure functions both backends share.

A tensor's values lie in a **storage**, a flat run of memory. Its **shape** says how many values each axis has, its
**strides** how far apart in the storage two neighbours along each axis lie (in values, not bytes), and its **offset**
where the first value lies. Value [i, j, k] is storage[offset + i * strides[0] + j * strides[1] + k * strides[2]].

A **view** is a new shape, strides and offset over the same storage: nothing is copied. Transposing swaps two strides;
slicing moves the offset and multiplies strides by the steps; broadcasting repeats values with a stride of 0; a reshape
is a view when the values, read in the new shape's order, are still evenly spaced (view_strides), else a copy. The
functions here compute those layouts and nothing else; tensor.py makes the views, the backends hold the storage (cpu.py
as NumPy arrays, cuda.py as device memory with ops.cu's strided copy). As MiniTorch's tensor_data.py and PyTorch's.
"""

from __future__ import annotations

import math
import operator

Shape = tuple[int, ...]


def contiguous_strides(shape: Shape) -> Shape:
    """Row-major strides: strides[d] = shape[d+1] * ... * shape[-1] (the last axis 1 apart)."""
    return tuple(math.prod(max(n, 1) for n in shape[d + 1:]) for d in range(len(shape)))


def index_to_position(index: Shape, strides: Shape, offset: int = 0) -> int:
    """Where value `index` lies in the storage: offset + sum of index[d] * strides[d]."""
    return offset + sum(i * s for i, s in zip(index, strides))


def is_contiguous(shape: Shape, strides: Shape) -> bool:
    """Whether the values lie row-major without gaps, from the first on (an axis of size 1 may have any stride, as in
    PyTorch: it is never stepped along)."""
    expected = 1
    for n, s in zip(reversed(shape), reversed(strides)):
        if n != 1 and s != expected:
            return False
        expected *= n
    return True


def permute(shape: Shape, strides: Shape, dims: Shape) -> tuple[Shape, Shape]:
    """Axes reordered: new axis d is old axis dims[d], with its size and its stride."""
    if sorted(dims) != list(range(len(shape))):
        raise ValueError(f"permute needs each of the {len(shape)} axes once, got {tuple(dims)}")
    return tuple(shape[d] for d in dims), tuple(strides[d] for d in dims)


def broadcast_strides(shape: Shape, strides: Shape, target: Shape) -> Shape:
    """The strides that read (shape, strides) repeated to `target` (NumPy's rule, shapes lined up from the right): an
    axis added in front, or an axis of size 1 stretched, gets stride 0, every step along it reading the same value."""
    lead = len(target) - len(shape)
    if lead < 0 or any(n != t and n != 1 for n, t in zip(shape, target[lead:])):
        raise ValueError(f"shape {shape} does not broadcast to {target}")
    return (0,) * lead + tuple(0 if n == 1 and t != 1 else s for n, s, t in zip(shape, strides, target[lead:]))


def view_strides(shape: Shape, strides: Shape, new_shape: Shape) -> Shape | None:
    """The strides that read the same values in row-major order as new_shape, without a copy; None where none do (the
    values of one new axis would not be evenly spaced). PyTorch's computeStride: the old axes are cut into chunks that
    are contiguous among themselves, and each chunk must be made of whole new axes."""
    if not shape or math.prod(shape) == 0:
        return contiguous_strides(new_shape)
    new = [0] * len(new_shape)
    view_d, chunk_stride, old_count, new_count = len(new_shape) - 1, strides[-1], 1, 1
    for d in range(len(shape) - 1, -1, -1):
        old_count *= shape[d]
        if d == 0 or (shape[d - 1] != 1 and strides[d - 1] != old_count * chunk_stride):  # the end of a chunk
            while view_d >= 0 and (new_count < old_count or new_shape[view_d] == 1):
                new[view_d] = new_count * chunk_stride
                new_count *= new_shape[view_d]
                view_d -= 1
            if new_count != old_count:
                return None
            if d > 0:
                chunk_stride, old_count, new_count = strides[d - 1], 1, 1
    return tuple(new) if view_d == -1 else None


def infer_shape(size: int, shape: Shape) -> Shape:
    """`shape` with its one -1 (if any) replaced by what is left of `size`; refused unless it holds `size` values."""
    if shape.count(-1) > 1 or any(n < -1 for n in shape):
        raise ValueError(f"a shape has sizes >= 0 and at most one -1, got {shape}")
    known = math.prod(n for n in shape if n != -1)
    if -1 in shape and known and size % known == 0:
        shape = tuple(size // known if n == -1 else n for n in shape)
    if -1 in shape or math.prod(shape) != size:
        raise ValueError(f"cannot reshape a tensor of size {size} into shape {shape}")
    return shape


def index(shape: Shape, strides: Shape, key) -> tuple[Shape, Shape, int]:
    """Basic indexing, as NumPy's and PyTorch's: (shape, strides, offset from the first value) of x[key], for an int,
    a slice, or a tuple of them (axes not named are kept whole). An int i picks one position, dropping its axis; a
    slice start:stop:step keeps the axis, its size the count of positions, its stride step times the old one."""
    key = key if isinstance(key, tuple) else (key,)
    if len(key) > len(shape):
        raise IndexError(f"too many indices ({len(key)}) for a tensor of {len(shape)} axes")
    new_shape, new_strides, offset = [], [], 0
    for d, k in enumerate(key):
        n, s = shape[d], strides[d]
        if isinstance(k, slice):
            if k.step is not None and k.step <= 0:
                raise ValueError(f"slice steps must be positive (as PyTorch's), got {k.step}")
            start, stop, step = k.indices(n)
            new_shape.append(len(range(start, stop, step)))
            new_strides.append(s * step)
            offset += start * s if new_shape[-1] else 0
        elif hasattr(k, "__index__") and not isinstance(k, bool):
            if not -n <= operator.index(k) < n:
                raise IndexError(f"index {k} is out of range for axis {d} of size {n}")
            offset += (operator.index(k) % n) * s
        else:
            raise TypeError(f"indices are ints and slices (basic indexing), got {type(k).__name__}")
    return tuple(new_shape) + shape[len(key):], tuple(new_strides) + strides[len(key):], offset
