"""The prefix cache on disk: pages round-trip, damaged or foreign files are ignored and
deleted, a full disk stops writing without harm, two processes share one folder, and the
budget and owners decide what is deleted."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from dataclasses import replace

import pytest
import torch

from app.engine.kv_disk import KVDiskStore, StoreIdentity, chain_keys

IDENTITY = StoreIdentity("ab" * 32, "float32", "float32", page_size=4, n_layers=2, n_kv_heads=1, head_dim=8)


def page(seed: int) -> torch.Tensor:
    return torch.randn(IDENTITY.page_shape, generator=torch.Generator().manual_seed(seed))


@pytest.fixture
def store(tmp_path):
    return KVDiskStore(tmp_path / "kv", IDENTITY, budget_bytes=10**9)


def fill(store, tokens, owner=None):
    keys = chain_keys(store.identity, tokens)
    parent = None
    for i, key in enumerate(keys):
        store.write(key, parent, tokens[4 * i: 4 * i + 4], page(i), owner)
        parent = key
    return keys


def test_pages_round_trip_and_shared_prefixes_share_files(store):
    tokens = list(range(100, 112))
    keys = fill(store, tokens)
    assert store.saved_prefix(keys) == 3
    got_tokens, kv = store.read(keys[1])
    assert got_tokens == tokens[4:8] and torch.equal(kv, page(1))
    other = tokens[:8] + [7, 7, 7, 7]  # same first two pages, another third one
    other_keys = chain_keys(IDENTITY, other)
    assert other_keys[:2] == keys[:2] and other_keys[2] != keys[2]
    assert store.saved_prefix(other_keys) == 2
    assert chain_keys(IDENTITY, tokens[:7]) == keys[:1]  # only full pages have keys


@pytest.mark.parametrize("damage", ["flip_payload", "truncate", "garbage", "empty", "bad_header"])
def test_damaged_files_are_ignored_and_deleted(store, damage):
    key = fill(store, list(range(4)))[0]
    path = store._path(key)
    data = bytearray(path.read_bytes())
    if damage == "flip_payload":
        data[-3] ^= 0xFF
    elif damage == "truncate":
        data = data[: len(data) // 2]
    elif damage == "garbage":
        data = bytearray(b"not a page at all" * 10)
    elif damage == "empty":
        data = bytearray()
    else:
        data[10:20] = b"{{{{{{{{{{"
    path.write_bytes(bytes(data))
    assert store.read(key) is None
    assert not path.exists()
    assert store.saved_prefix([key]) == 0


def test_pages_of_another_model_dtype_or_page_size_are_never_found(tmp_path):
    tokens = list(range(8))
    first = KVDiskStore(tmp_path, IDENTITY, 10**9)
    fill(first, tokens)
    for other in (replace(IDENTITY, model_sha256="cd" * 32), replace(IDENTITY, kv_dtype="bfloat16"),
                  replace(IDENTITY, page_size=8), replace(IDENTITY, weights="bfloat16")):
        store = KVDiskStore(tmp_path, other, 10**9)
        assert store.saved_prefix(chain_keys(other, tokens)) == 0
    # A file moved into another identity's folder under the same name is refused by its header.
    foreign = KVDiskStore(tmp_path, replace(IDENTITY, model_sha256="ef" * 32), 10**9)
    key = chain_keys(IDENTITY, tokens)[0]
    target = foreign._path(key)
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_bytes(first._path(key).read_bytes())
    assert foreign.read(key) is None and not target.exists()


def test_a_full_disk_stops_writing_and_leaves_no_partial_file(tmp_path):
    # A real write failure: the child process may not write files over 600 bytes (a page is more).
    code = textwrap.dedent(f"""
        import resource, signal, sys, torch
        from pathlib import Path
        sys.path.insert(0, {str(__import__('pathlib').Path(__file__).resolve().parents[2])!r})
        from app.engine.kv_disk import KVDiskStore, StoreIdentity, chain_keys
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        ident = StoreIdentity("ab" * 32, "float32", "float32", 4, 2, 1, 8)
        store = KVDiskStore(Path({str(tmp_path)!r}), ident, 10**9)
        resource.setrlimit(resource.RLIMIT_FSIZE, (600, 600))
        key = chain_keys(ident, list(range(4)))[0]
        ok = store.write(key, None, list(range(4)), torch.zeros(ident.page_shape))
        print(ok, store.writable, store.write(key, None, list(range(4)), torch.zeros(ident.page_shape)))
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["False", "False", "False"]
    store = KVDiskStore(tmp_path, IDENTITY, 10**9)
    assert not list(store.folder.glob("??/*"))  # no page and no temporary file left behind


def test_two_processes_writing_one_folder_leave_only_whole_pages(tmp_path):
    code = textwrap.dedent(f"""
        import sys, torch
        from pathlib import Path
        sys.path.insert(0, {str(__import__('pathlib').Path(__file__).resolve().parents[2])!r})
        from app.engine.kv_disk import KVDiskStore, StoreIdentity, chain_keys
        ident = StoreIdentity("ab" * 32, "float32", "float32", 4, 2, 1, 8)
        store = KVDiskStore(Path({str(tmp_path)!r}), ident, 10**9)
        seed = int(sys.argv[1])
        for round in range(30):
            tokens = [round % 7] * 8 + [seed, round] * 2  # shared first pages, own last one
            keys = chain_keys(ident, tokens)
            for i, key in enumerate(keys):
                g = torch.Generator().manual_seed(hash(key) % 2**31)
                store.write(key, None, tokens[4*i:4*i+4], torch.randn(ident.page_shape, generator=g))
                assert store.read(key) is not None
    """)
    procs = [subprocess.Popen([sys.executable, "-c", code, str(seed)]) for seed in (1, 2)]
    assert [p.wait(timeout=600) for p in procs] == [0, 0]
    store = KVDiskStore(tmp_path, IDENTITY, 10**9)
    files = list(store.folder.glob("??/*.kv"))
    assert files and not list(store.folder.glob("??/.tmp-*"))
    for f in files:
        assert store.read(f.stem) is not None


def test_budget_deletes_least_recently_used_pages(store):
    import os
    import time

    keys = fill(store, list(range(16)))
    now = time.time()
    for age, key in enumerate(keys):  # keys[0] oldest
        os.utime(store._path(key), (now - 100 + age, now - 100 + age))
    store.read(keys[0])  # reading refreshes it: now the newest
    store.budget_bytes = sum(store._path(k).stat().st_size for k in (keys[0], keys[3]))
    assert store.enforce_budget() == 2
    assert [store.contains(k) for k in keys] == [True, False, False, True]


def test_forgetting_a_chat_deletes_only_what_it_alone_used(store):
    shared = list(range(8))
    a = fill(store, shared + [1, 1, 1, 1], owner="chat-a")
    b = fill(store, shared + [2, 2, 2, 2], owner="chat-b")
    assert store.forget_owner("chat-a") == 1
    assert [store.contains(k) for k in a] == [True, True, False]
    assert all(store.contains(k) for k in b)
    assert store.forget_owner("chat-b") == 3
    assert not any(store.contains(k) for k in b)


def test_the_writer_forgets_an_owner_after_the_pages_queued_before(store, monkeypatch):
    """A chat deleted for good while its pages are still queued: the writer deletes them
    in turn, after writing them, so none is written after the deletion and stays."""
    import threading

    from app.engine.kv_disk import KVDiskWriter

    gate = threading.Event()
    write = store.write

    def held(*args):  # the writer is busy while the pages and the forget are queued
        gate.wait(10)
        return write(*args)

    monkeypatch.setattr(store, "write", held)
    writer = KVDiskWriter(store)
    tokens = list(range(12))
    keys = chain_keys(store.identity, tokens)
    parent = None
    for i, key in enumerate(keys):
        writer.put(key, parent, tokens[4 * i: 4 * i + 4], page(i), "chat-a")
        parent = key
    writer.forget("chat-a")
    gate.set()
    writer.close()
    assert not any(store.contains(k) for k in keys)
    assert not list(store.folder.glob("??/*"))  # no page, no owners file
