"""The blob cache: whole verified blobs only, pinned blobs survive collection, least
recently used go first, one download per blob across processes."""

from __future__ import annotations

import hashlib
import multiprocessing
import os
import time
from pathlib import Path

import pytest

from aenv.storage.blob_cache import BlobCache
from aenv.storage.registry_errors import DigestMismatch


def _d(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def test_a_blob_that_does_not_match_is_never_kept(tmp_path) -> None:
    cache = BlobCache(tmp_path, 1 << 20)
    with pytest.raises(DigestMismatch):
        cache.put(_d(b"right"), b"wrong")
    assert not cache.has(_d(b"right")) and list((tmp_path / "tmp").iterdir()) == []


def test_collection_spares_pinned_blobs_and_takes_the_oldest_first(tmp_path) -> None:
    cache = BlobCache(tmp_path, 16)
    blobs = [bytes([i]) * 8 for i in range(3)]
    for i, b in enumerate(blobs):
        cache.put(_d(b), b)
        os.utime(cache.path(_d(b)), (1000 + i, 1000 + i))
    with cache.use(_d(blobs[0])):  # the oldest, but pinned (and now the newest)
        os.utime(cache.path(_d(blobs[0])), (900, 900))
        done = cache.collect()
    assert cache.has(_d(blobs[0])) and not cache.has(_d(blobs[1]))
    assert cache.has(_d(blobs[2])) and done.pinned == 1 and done.removed == 1


def _download(root: str, data: bytes, q: multiprocessing.Queue) -> None:
    cache = BlobCache(Path(root), 1 << 20)
    with cache.writing(_d(data), len(data)) as w:
        if w is not None:
            time.sleep(0.3)
            w.write(data)
        q.put(w is not None)


def test_two_processes_download_one_blob_once(tmp_path) -> None:
    q: multiprocessing.Queue = multiprocessing.Queue()
    procs = [multiprocessing.Process(target=_download, args=(str(tmp_path), b"x" * 99, q))
             for _ in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(10)
    assert sorted(q.get() for _ in procs) == [False, True]
    assert BlobCache(tmp_path, 1 << 20).read(_d(b"x" * 99)) == b"x" * 99
