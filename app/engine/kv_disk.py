"""The prefix cache on disk: KV pages saved so a conversation resumes warm after a restart.

Layout. One folder per *store identity* (model file sha256, weight format, KV dtype, page
size and KV shape): pages computed by another model, dtype or page size can never be found.
A page file holds one full page of one conversation: its tokens, the key of the page before
it, and its keys and values for every layer, [L, 2, page_size, Hkv, D].

Keys form a hash chain: key(page i) = sha256(key(page i - 1) || tokens of page i), starting
from the identity's hash. A key therefore names the whole prefix up to and including its
page, so conversations that share a prefix share its files, and looking a prompt up is a
walk down its pages until the first key with no file.

Safety. Files are written to a temporary name and renamed into place (atomic on every OS we
support), so a reader -- this process or another one sharing the data folder -- sees a
whole file or none. Every read checks the magic, the header, the identity, the key, the
payload length and a checksum; a file that fails any check is logged, deleted and treated as
absent: never a crash, never wrong output. A full disk stops writing (logged), nothing else.

Budget. `enforce_budget` deletes least recently used files (by modification time, which a
read refreshes) until the folder fits. `forget_owner` deletes the pages only one owner (a
chat) reached.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import struct
import tempfile
import zlib
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

log = logging.getLogger(__name__)

MAGIC = b"FXKV\x01\x00"
_HEADER_LEN = struct.Struct("<I")
_MAX_HEADER = 1 << 20
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class StoreIdentity:
    model_sha256: str
    weights: str  # e.g. "float16+bfloat16": other weights give other keys and values
    kv_dtype: str  # "float32", "bfloat16", ...
    page_size: int
    n_layers: int
    n_kv_heads: int
    head_dim: int

    @property
    def digest(self) -> bytes:
        return hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode()).digest()

    @property
    def folder_name(self) -> str:
        return self.digest.hex()[:24]

    @property
    def page_shape(self) -> tuple[int, ...]:
        return (self.n_layers, 2, self.page_size, self.n_kv_heads, self.head_dim)

    @property
    def torch_dtype(self) -> torch.dtype:
        return _DTYPES[self.kv_dtype]

    @property
    def payload_bytes(self) -> int:
        n = 1
        for d in self.page_shape:
            n *= d
        return n * torch.finfo(self.torch_dtype).bits // 8


def chain_keys(identity: StoreIdentity, tokens: Sequence[int]) -> list[str]:
    """Hex keys of every full page of `tokens`, in order."""
    ps = identity.page_size
    key = identity.digest
    keys = []
    for start in range(0, len(tokens) - ps + 1, ps):
        page = struct.pack(f"<{ps}q", *tokens[start:start + ps])
        key = hashlib.sha256(key + page).digest()
        keys.append(key.hex())
    return keys


class KVDiskStore:
    def __init__(self, root: Path, identity: StoreIdentity, budget_bytes: int):
        self.identity = identity
        self.folder = Path(root) / identity.folder_name
        self.folder.mkdir(parents=True, exist_ok=True)
        self.budget_bytes = budget_bytes
        self.writable = True
        self._write_identity()

    def _write_identity(self) -> None:
        path = self.folder / "identity.json"
        if not path.exists():
            self._atomic_write(path, json.dumps(asdict(self.identity), indent=1).encode())

    def _path(self, key: str) -> Path:
        return self.folder / key[:2] / f"{key}.kv"

    def contains(self, key: str) -> bool:
        return self._path(key).is_file()

    def saved_prefix(self, keys: Sequence[str]) -> int:
        """How many of `keys` (a prompt's chain, in order) have files, from the start."""
        n = 0
        for key in keys:
            if not self.contains(key):
                break
            n += 1
        return n

    # ---- writing -----------------------------------------------------------------------------

    def write(self, key: str, parent: str | None, tokens: Sequence[int], kv: torch.Tensor | None,
              owner: str | None = None) -> bool:
        """Save one page (kv: [L, 2, page_size, Hkv, D] on the CPU). False if not written
        (already there, the disk is full, the store stopped writing)."""
        if not self.writable:
            return False
        path = self._path(key)
        if path.exists() or kv is None:  # kv None: the page is known saved, only the owner is new
            if owner is not None and path.exists():
                self._add_owner(key, owner)
            return False
        if tuple(kv.shape) != self.identity.page_shape or len(tokens) != self.identity.page_size:
            raise ValueError(f"page of shape {tuple(kv.shape)} / {len(tokens)} tokens does not fit the store")
        payload = kv.to(self.identity.torch_dtype).contiguous().view(torch.uint8).numpy().tobytes()
        header = json.dumps({"identity": self.identity.digest.hex(), "key": key, "parent": parent,
                             "tokens": list(map(int, tokens)), "crc32": zlib.crc32(payload)}).encode()
        data = MAGIC + _HEADER_LEN.pack(len(header)) + header + payload
        path.parent.mkdir(exist_ok=True)
        try:
            self._atomic_write(path, data)
        except OSError as exc:
            log.warning("KV cache on disk: writing stopped (%s)", exc)
            self.writable = False
            return False
        if owner is not None:
            self._add_owner(key, owner)
        return True

    def _atomic_write(self, path: Path, data: bytes) -> None:
        fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=path.parent)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(tmp, path)
        except BaseException:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise

    # ---- reading -----------------------------------------------------------------------------

    def read(self, key: str) -> tuple[list[int], torch.Tensor] | None:
        """(tokens, kv [L, 2, page_size, Hkv, D]) of a saved page, or None when it is absent
        or damaged (a damaged file is deleted)."""
        path = self._path(key)
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            return None
        except OSError as exc:
            log.warning("KV cache on disk: cannot read %s (%s)", path.name, exc)
            return None
        page = self._parse(data, key)
        if page is None:
            self._discard(path, "damaged or written for another model")
            return None
        try:
            os.utime(path)  # recently used: the budget evicts it last
        except OSError:
            pass
        return page

    def _parse(self, data: bytes, key: str) -> tuple[list[int], torch.Tensor] | None:
        ident = self.identity
        if not data.startswith(MAGIC) or len(data) < len(MAGIC) + _HEADER_LEN.size:
            return None
        (length,) = _HEADER_LEN.unpack_from(data, len(MAGIC))
        start = len(MAGIC) + _HEADER_LEN.size
        if length > _MAX_HEADER or start + length > len(data):
            return None
        try:
            header = json.loads(data[start:start + length])
        except (UnicodeDecodeError, json.JSONDecodeError):
            return None
        payload = data[start + length:]
        tokens = header.get("tokens") if isinstance(header, dict) else None
        if (header.get("identity") != ident.digest.hex() or header.get("key") != key
                or not isinstance(tokens, list) or len(tokens) != ident.page_size
                or not all(isinstance(t, int) for t in tokens)
                or len(payload) != ident.payload_bytes or header.get("crc32") != zlib.crc32(payload)):
            return None
        kv = torch.frombuffer(bytearray(payload), dtype=torch.uint8).view(ident.torch_dtype)
        return tokens, kv.view(ident.page_shape)

    def _discard(self, path: Path, why: str) -> None:
        log.warning("KV cache on disk: ignoring %s (%s); deleted", path.name, why)
        try:
            path.unlink()
        except OSError:
            pass

    # ---- owners and budget -------------------------------------------------------------------

    def _add_owner(self, key: str, owner: str) -> None:
        """Owners live in a small side file per page, so adding one never rewrites the page."""
        side = self._path(key).with_suffix(".owners")
        try:
            owners = set(side.read_text().split()) if side.exists() else set()
            if owner not in owners:
                self._atomic_write(side, "\n".join(sorted(owners | {owner})).encode())
        except OSError as exc:
            log.warning("KV cache on disk: cannot record an owner (%s)", exc)

    def _owners(self, path: Path) -> set[str]:
        side = path.with_suffix(".owners")
        try:
            return set(side.read_text().split()) if side.exists() else set()
        except OSError:
            return set()

    def _page_files(self) -> list[Path]:
        return list(self.folder.glob("??/*.kv"))

    def forget_owner(self, owner: str) -> int:
        """Delete the pages only `owner` reached; returns how many were deleted."""
        deleted = 0
        for path in self._page_files():
            owners = self._owners(path)
            if owner in owners:
                rest = owners - {owner}
                if rest:
                    try:
                        self._atomic_write(path.with_suffix(".owners"), "\n".join(sorted(rest)).encode())
                    except OSError:
                        pass
                    continue
                for p in (path, path.with_suffix(".owners")):
                    try:
                        p.unlink()
                    except OSError:
                        pass
                deleted += 1
        return deleted

    def size_bytes(self) -> int:
        return sum(p.stat().st_size for p in self._page_files() if p.exists())

    def enforce_budget(self) -> int:
        """Delete least recently used pages until the store fits its budget; returns how many."""
        entries = []
        for p in self._page_files():
            try:
                st = p.stat()
            except OSError:
                continue
            entries.append((st.st_mtime, st.st_size, p))
        total = sum(e[1] for e in entries)
        deleted = 0
        for _, size, path in sorted(entries, key=lambda e: e[0]):
            if total <= self.budget_bytes:
                break
            for p in (path, path.with_suffix(".owners")):
                try:
                    p.unlink()
                except OSError:
                    pass
            total -= size
            deleted += 1
        return deleted


def default_budget_bytes(folder: Path) -> int:
    """2 GB, or a tenth of the free space where that is less."""
    import shutil

    try:
        free = shutil.disk_usage(folder).free
    except OSError:
        return 2 * 10**9
    return int(min(2 * 10**9, free // 10))


class KVDiskWriter:
    """Writes pages on its own thread, so saving never runs on the decode path; enforces the
    budget after each batch. `forget` deletes an owner's pages in turn with the writes, after
    every page queued before it (deleted at once, a page still queued for a chat deleted for
    good was written after its deletion, and stayed). `close` writes what is queued, then
    stops."""

    def __init__(self, store: KVDiskStore):
        import queue
        import threading

        self.store = store
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._loop, name="ferrox-kv-writer", daemon=True)
        self._thread.start()

    def put(self, key: str, parent: str | None, tokens: Sequence[int], kv: torch.Tensor | None,
            owner: str | None = None) -> None:
        self._queue.put(("put", (key, parent, list(tokens), kv, owner)))

    def forget(self, owner: str) -> None:
        self._queue.put(("forget", owner))

    def close(self, timeout: float = 60.0) -> None:
        self._queue.put(None)
        self._thread.join(timeout)

    def _loop(self) -> None:
        while True:
            batch = [self._queue.get()]
            while not self._queue.empty():
                batch.append(self._queue.get())
            jobs = [item for item in batch if item is not None]
            wrote = False
            for kind, arg in jobs:
                try:
                    if kind == "put":
                        wrote |= self.store.write(*arg)
                    else:
                        self.store.forget_owner(arg)
                except Exception:  # never let one page stop the writer
                    log.exception("KV cache on disk: %s failed", kind)
            if wrote:
                try:
                    self.store.enforce_budget()
                except OSError as exc:
                    log.warning("KV cache on disk: budget check failed (%s)", exc)
            if len(jobs) < len(batch):  # close() was called
                return


def model_fingerprint(path: Path, cache_file: Path) -> str:
    """The sha256 of a model file (or of a folder's weight files), computed once per
    (path, size, modification time) and remembered in `cache_file`."""
    path = Path(path)
    files = sorted(path.glob("*.safetensors")) if path.is_dir() else [path]
    stamp = ";".join(f"{f}:{f.stat().st_size}:{f.stat().st_mtime_ns}" for f in files)
    try:
        known = json.loads(Path(cache_file).read_text())
    except (OSError, ValueError):
        known = {}
    if not isinstance(known, dict):
        known = {}
    if isinstance(known.get(stamp), str):
        return known[stamp]
    digest = hashlib.sha256()
    for f in files:
        with open(f, "rb") as handle:
            for block in iter(lambda: handle.read(1 << 22), b""):
                digest.update(block)
    value = digest.hexdigest()
    known[stamp] = value
    try:
        Path(cache_file).parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(cache_file).with_suffix(".tmp")
        tmp.write_text(json.dumps(known))
        os.replace(tmp, cache_file)
    except OSError:
        pass
    return value


def open_store(root: Path, loaded, page_size: int, budget_bytes: int | None = None) -> KVDiskStore:
    """The store for this loaded model (`app.models.loader.LoadedModel`) in `root`: keyed by
    the model file's sha256, the weight format, the KV dtype, the page size and KV shape."""
    root = Path(root)
    kv = loaded.kv_facts
    identity = StoreIdentity(
        model_sha256=model_fingerprint(loaded.path, root / "fingerprints.json"),
        weights=loaded.weights_label, kv_dtype=str(loaded.kv_dtype).removeprefix("torch."),
        page_size=page_size, n_layers=kv.n_layers, n_kv_heads=kv.n_kv_heads, head_dim=kv.head_dim)
    return KVDiskStore(root, identity, budget_bytes if budget_bytes is not None else default_budget_bytes(root))
