"""NCCL, called through cffi: the few functions level 9's GPU step needs, from the library PyTorch's CUDA build ships.

NCCL (NVIDIA's collective communications library) is what DistributedDataParallel itself calls on GPUs; here we call
it without PyTorch in between. The library is libnccl.so.2 from the nvidia-nccl wheel that a CUDA build of PyTorch
installs (or one on the loader's path), loaded in cffi's ABI mode: no compiler, no header, only the declarations below,
written from NCCL's nccl.h. Its enumerations are C ints, so they travel as ints.

How ranks meet: rank 0 asks NCCL for a unique id (128 bytes), sends it to the other ranks by any channel (level 9 uses
its gloo process group), and every rank then joins the same communicator with it. A collective such as all_reduce is
queued on a CUDA stream and returns at once; the GPU runs it after the work queued before it on that stream.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from cffi import FFI

ffi = FFI()
ffi.cdef("""
typedef struct ncclComm *ncclComm_t;
typedef struct { char internal[128]; } ncclUniqueId;
int ncclGetVersion(int *version);
int ncclGetUniqueId(ncclUniqueId *uniqueId);
int ncclCommInitRank(ncclComm_t *comm, int nranks, ncclUniqueId commId, int rank);
int ncclAllReduce(const void *sendbuff, void *recvbuff, size_t count, int datatype, int op, ncclComm_t comm,
                  void *stream);
int ncclRedOpCreatePreMulSum(int *op, void *scalar, int datatype, int residence, ncclComm_t comm);
int ncclRedOpDestroy(int op, ncclComm_t comm);
int ncclGroupStart(void);
int ncclGroupEnd(void);
int ncclMemAlloc(void **ptr, size_t size);
const char *ncclGetErrorString(int result);
const char *ncclGetLastError(ncclComm_t comm);
""")

SUCCESS = 0  # ncclSuccess
FLOAT32 = 7  # ncclFloat32
SCALAR_ON_HOST = 1  # ncclScalarHostImmediate: the scalar is read when the operator is made
UNIQUE_ID_BYTES = 128


class NCCLError(RuntimeError):
    """A NCCL call failed; the message is NCCL's."""


class NCCLUnavailable(OSError):
    """No NCCL library on this machine (PyTorch without CUDA, say)."""


def library_path() -> str:
    """libnccl.so.2 from the nvidia-nccl wheel if installed, else the name for the loader to search."""
    spec = importlib.util.find_spec("nvidia.nccl") if importlib.util.find_spec("nvidia") else None
    for folder in (spec.submodule_search_locations or []) if spec else []:
        path = Path(folder, "lib", "libnccl.so.2")
        if path.exists():
            return str(path)
    return "libnccl.so.2"


_lib = None


def lib():
    """The loaded library (loaded once, at first use)."""
    global _lib
    if _lib is None:
        path = library_path()
        try:
            _lib = ffi.dlopen(path)
        except OSError as error:
            raise NCCLUnavailable(f"NCCL is not installed here ({path}: {error}); it comes with PyTorch's CUDA build "
                                  "(the nvidia-nccl-cu13 wheel)") from error
    return _lib


def _check(result: int, call: str, comm=None) -> None:
    if result != SUCCESS:
        detail = ffi.string(lib().ncclGetLastError(comm if comm is not None else ffi.NULL)).decode(errors="replace")
        reason = ffi.string(lib().ncclGetErrorString(result)).decode(errors="replace")
        raise NCCLError(f"{call}: {reason}" + (f" ({detail})" if detail else ""))


def version() -> str:
    """The library's version, as "major.minor.patch" (NCCL_VERSION_CODE is major * 10000 + minor * 100 + patch)."""
    code = ffi.new("int *")
    _check(lib().ncclGetVersion(code), "ncclGetVersion")
    return f"{code[0] // 10000}.{code[0] // 100 % 100}.{code[0] % 100}"


def unique_id() -> bytes:
    """A new communicator's id, made by rank 0 and sent to every other rank (it needs no GPU)."""
    ident = ffi.new("ncclUniqueId *")
    _check(lib().ncclGetUniqueId(ident), "ncclGetUniqueId")
    return bytes(ffi.buffer(ident))


class Communicator:
    """This rank's place in a group of `world` ranks, one GPU each (the current CUDA device). Every rank must make it
    with the same id, and then call the same collectives in the same order. It lasts as long as its process: a level-9
    worker's life."""

    def __init__(self, ident: bytes, world: int, rank: int):
        if len(ident) != UNIQUE_ID_BYTES:
            raise ValueError(f"a NCCL unique id is {UNIQUE_ID_BYTES} bytes, got {len(ident)}")
        if not 0 <= rank < world:
            raise ValueError(f"rank must be in [0, {world}), got {rank}")
        handle = ffi.new("ncclComm_t *")
        unique = ffi.new("ncclUniqueId *")
        ffi.memmove(unique, ident, UNIQUE_ID_BYTES)
        _check(lib().ncclCommInitRank(handle, world, unique[0], rank), "ncclCommInitRank")  # waits for every rank
        self.comm, self.world, self.rank = handle[0], world, rank

    def all_reduce(self, buffers: list[tuple[int, int, int]], scale: float, stream: int) -> None:
        """Queue on `stream`, for each (source, target, count) of float32s at those device addresses (the same
        address: in place): target = the sum over the ranks of scale_r * source_r. Each rank brings its own scale
        (NCCL's PreMulSum): a rank's share of the batch, so that the sum is the mean over the whole batch. The
        buffers go as one group: NCCL launches them together, not one after another."""
        op = ffi.new("int *")
        scalar = ffi.new("float *", scale)
        _check(lib().ncclRedOpCreatePreMulSum(op, scalar, FLOAT32, SCALAR_ON_HOST, self.comm),
               "ncclRedOpCreatePreMulSum", self.comm)
        try:
            _check(lib().ncclGroupStart(), "ncclGroupStart")
            try:
                for source, target, count in buffers:
                    result = lib().ncclAllReduce(ffi.cast("void *", source), ffi.cast("void *", target), count,
                                                 FLOAT32, op[0], self.comm, ffi.cast("void *", stream))
                    _check(result, "ncclAllReduce", self.comm)
            finally:
                _check(lib().ncclGroupEnd(), "ncclGroupEnd", self.comm)
        finally:  # NCCL allows it as soon as the last call that uses the operator has returned
            _check(lib().ncclRedOpDestroy(op[0], self.comm), "ncclRedOpDestroy", self.comm)


class DeviceBuffer:
    """`floats` float32s of device memory from NCCL's own allocator, for a planted bug's buffer that nothing reads;
    kept for the life of its process."""

    def __init__(self, floats: int):
        pointer = ffi.new("void **")
        _check(lib().ncclMemAlloc(pointer, 4 * floats), "ncclMemAlloc")
        self.pointer, self.floats = pointer[0], floats

    @property
    def address(self) -> int:
        return int(ffi.cast("uintptr_t", self.pointer))
