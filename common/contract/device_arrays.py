"""Arrays already on a CUDA device, as the MLP's GPU levels read them in place: any object exposing
__cuda_array_interface__ (PyTorch CUDA tensors, CuPy, Numba) or DLPack (__dlpack__ and __dlpack_device__), read
without importing the library that made it.

Both protocols describe the same four things - a device pointer, a dtype, a shape, strides - and this module reads
them into a DeviceArray; common/contract checks them (check_device_data) and the library checks the rest on the
device (mlp_use_device_data in common/native/mlp.h: which device the memory is on, and every label).
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import numpy as np
from cffi import FFI

# DLPack's structs (dlpack.h): the unversioned DLManagedTensor, which every producer gives when no max_version is asked.
ffi = FFI()
ffi.cdef("""
typedef struct { int device_type; int device_id; } DLDevice;
typedef struct { uint8_t code; uint8_t bits; uint16_t lanes; } DLDataType;
typedef struct {
    void *data; DLDevice device; int32_t ndim; DLDataType dtype; int64_t *shape; int64_t *strides; uint64_t byte_offset;
} DLTensor;
typedef struct DLManagedTensor {
    DLTensor dl_tensor; void *manager_ctx; void (*deleter)(struct DLManagedTensor *self);
} DLManagedTensor;
""")
CUDA_DEVICES = (2, 13)  # DLPack's kDLCUDA and kDLCUDAManaged
DLPACK_TYPES = {0: "int", 1: "uint", 2: "float", 4: "bfloat", 5: "complex", 6: "bool"}  # DLDataType's code
CAI_VERSIONS = (2, 3)  # of the CUDA array interface: 2 is PyTorch's, 3 (a stream to wait for) CuPy's and Numba's
# The capsule's pointer, called with the GIL held, as the Python C API needs (cffi would release it around a call).
_capsule_pointer = ctypes.PYFUNCTYPE(ctypes.c_void_p, ctypes.py_object, ctypes.c_char_p)(
    ("PyCapsule_GetPointer", ctypes.pythonapi))


@dataclass(frozen=True)
class DeviceArray:
    """An array on a CUDA device, as its protocol describes it, and the objects that keep its memory alive."""

    pointer: int
    dtype: str  # NumPy's name for it: "float32", "int64" ("bfloat16" and the like where NumPy has none)
    shape: tuple[int, ...]
    strides: tuple[int, ...] | None  # in bytes; None: C-contiguous
    owners: tuple  # hold these while the memory is read: the array, and its DLPack capsule

    def contiguous(self, itemsize: int) -> bool:
        """Row-major without gaps (a dimension of size 1 may have any stride)."""
        if self.strides is None:
            return True
        expected = itemsize
        for size, stride in reversed(list(zip(self.shape, self.strides))):
            if size != 1 and stride != expected:
                return False
            expected *= size
        return True


def on_device(a) -> bool:
    """True for an array on a CUDA device: it has a CUDA array interface, or DLPack places it on one (NumPy's, on
    the CPU, does not)."""
    if isinstance(a, np.ndarray):
        return False
    if _interface(a) is not None:
        return True
    device = getattr(a, "__dlpack_device__", None)
    return device is not None and device()[0] in CUDA_DEVICES


def device_array(a, name: str) -> DeviceArray | None:
    """a as a DeviceArray (through its CUDA array interface, else DLPack), or None where it is not on a CUDA device."""
    if not on_device(a):
        return None
    interface = _interface(a)
    return _from_interface(interface, a, name) if interface is not None else _from_dlpack(a)


def _interface(a) -> dict | None:
    """a.__cuda_array_interface__, or None where there is none (PyTorch's property raises for a tensor on the CPU)."""
    try:
        return a.__cuda_array_interface__
    except AttributeError:
        return None


def _from_interface(interface: dict, a, name: str) -> DeviceArray:
    """The CUDA array interface's dict, read. Its v3 `stream` is not needed: the library waits for the whole device."""
    if not isinstance(interface, dict) or not {"shape", "typestr", "data", "version"} <= interface.keys():
        raise TypeError(f"{name}.__cuda_array_interface__ must be a dict with shape, typestr, data and version, "
                        f"got {interface!r}")
    if interface["version"] not in CAI_VERSIONS:
        raise ValueError(f"{name}'s CUDA array interface is version {interface['version']!r}; this reader knows "
                         f"versions {' and '.join(map(str, CAI_VERSIONS))}")
    if interface.get("mask") is not None:
        raise ValueError(f"{name} is a masked array: the levels read every value")
    try:
        dtype = np.dtype(interface["typestr"])
    except TypeError as e:
        raise TypeError(f"{name}'s typestr {interface['typestr']!r} is not a NumPy type string") from e
    strides = interface.get("strides")
    return DeviceArray(int(interface["data"][0]), str(dtype), tuple(interface["shape"]),
                       None if strides is None else tuple(strides), (a,))


def _from_dlpack(a) -> DeviceArray:
    """The DLPack capsule's tensor, read. No `stream` is asked for: the library waits for the whole device. The capsule
    is not consumed (not renamed "used_dltensor"): kept in `owners`, it keeps the memory alive, and its producer's
    destructor frees it when it goes."""
    capsule = a.__dlpack__()
    tensor = ffi.cast("DLManagedTensor *", _capsule_pointer(capsule, b"dltensor")).dl_tensor
    code, bits, lanes = tensor.dtype.code, tensor.dtype.bits, tensor.dtype.lanes
    dtype = f"{DLPACK_TYPES.get(code, f'type{code}_')}{bits}" + (f"x{lanes}" if lanes != 1 else "")
    shape = tuple(tensor.shape[i] for i in range(tensor.ndim))
    itemsize = bits * lanes // 8
    strides = None if tensor.strides == ffi.NULL else tuple(tensor.strides[i] * itemsize for i in range(tensor.ndim))
    pointer = int(ffi.cast("uintptr_t", tensor.data)) + tensor.byte_offset
    return DeviceArray(pointer, dtype, shape, strides, (a, capsule))
