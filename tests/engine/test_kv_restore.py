"""A conversation's KV saved by one engine process is restored by the next: the follow-up
reports the restored tokens as cached, and its greedy tokens and logits equal those of a full
recompute (float32)."""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]


def run_child(model_path, store_dir, prompt, *extra):
    """What the child reported, its rows of logits under "logits" (numpy [tokens, vocab])."""
    logits = Path(store_dir).parent / f"logits-{uuid.uuid4().hex}.npy"
    out = subprocess.run([sys.executable, "-m", "tests.engine.kv_restore_child", str(model_path),
                          str(store_dir), json.dumps(prompt), str(logits), *extra],
                         cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    reported = json.loads(out.stdout.strip().splitlines()[-1])
    reported["logits"] = np.load(logits)
    return reported


@pytest.mark.slow
def test_a_new_process_restores_the_conversation_from_disk(embedded_model_path, tmp_path):
    store = tmp_path / "kv"
    first_prompt = [2] + [(i * 37) % 5000 + 100 for i in range(150)]
    first = run_child(embedded_model_path, store, first_prompt)
    assert first["restored"] == 0
    assert list((store).glob("*/??/*.kv")), "the first process saved its pages"
    # The follow-up: the whole first conversation plus a new turn.
    follow_up = first_prompt + first["ids"] + [(i * 11) % 3000 + 50 for i in range(20)]
    restored = run_child(embedded_model_path, store, follow_up)
    recomputed = run_child(embedded_model_path, tmp_path / "none", follow_up, "--no-store")
    pages_saved = (len(first_prompt) + len(first["ids"])) // 16
    assert restored["restored"] == pages_saved * 16 == restored["progress_restored"]
    assert restored["cached"] == restored["restored"] and recomputed["cached"] == 0
    assert restored["ids"] == recomputed["ids"]
    assert restored["logits"].shape == recomputed["logits"].shape == (len(restored["ids"]), 262_144)
    assert np.abs(restored["logits"] - recomputed["logits"]).max() < 1e-4


@pytest.mark.slow
def test_damaged_pages_are_recomputed_not_used(embedded_model_path, tmp_path):
    store = tmp_path / "kv"
    prompt = [2] + [(i * 13) % 4000 + 100 for i in range(80)]
    first = run_child(embedded_model_path, store, prompt)
    files = sorted(store.glob("*/??/*.kv"))
    for f in files:  # damage every page: the follow-up must compute everything itself
        data = bytearray(f.read_bytes())
        data[-1] ^= 0xFF
        f.write_bytes(bytes(data))
    follow_up = prompt + first["ids"] + [7, 8, 9]
    damaged = run_child(embedded_model_path, store, follow_up)
    recomputed = run_child(embedded_model_path, tmp_path / "none", follow_up, "--no-store")
    assert damaged["restored"] == 0 and damaged["ids"] == recomputed["ids"]


def test_pages_record_their_chat_and_forgetting_it_deletes_them(tiny, tmp_path):
    from app.engine.engine import Engine, EngineConfig
    from app.engine.kv_disk import KVDiskStore, StoreIdentity
    from app.engine.sampling import SamplingParams

    kv = tiny.kv_facts
    identity = StoreIdentity("tiny", tiny.weights_label, "float32", 16, kv.n_layers, kv.n_kv_heads, kv.head_dim)
    store = KVDiskStore(tmp_path, identity, 10**9)
    engine = Engine(tiny, EngineConfig(page_size=16, kv_tokens=2048), store)
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    shared = [2] + list(range(100, 163))  # 4 full pages shared by both chats
    engine.submit(shared + [5] * 16, params, "a", cache_owner="chat-a")
    engine.submit(shared + [6] * 16, params, "b", cache_owner="chat-b")
    while engine.has_work:
        engine.step()
    engine.close()
    files = list(store.folder.glob("??/*.kv"))
    assert len(files) == 4 + 2 * 1  # the shared pages once, then one own page each
    engine.forget_cache_owner("chat-a")
    assert len(list(store.folder.glob("??/*.kv"))) == 5
    engine.forget_cache_owner("chat-b")
    assert list(store.folder.glob("??/*.kv")) == []


def test_a_chat_forgotten_while_its_pages_wait_to_be_saved_leaves_none(tiny, tmp_path):
    """Forgotten between its reply and the saving of its pages (the engine saves them once
    idle): none is written afterwards; another chat's pages are."""
    from app.engine.engine import Engine, EngineConfig
    from app.engine.kv_disk import KVDiskStore, StoreIdentity
    from app.engine.sampling import SamplingParams

    kv = tiny.kv_facts
    identity = StoreIdentity("tiny", tiny.weights_label, "float32", 16, kv.n_layers, kv.n_kv_heads, kv.head_dim)
    store = KVDiskStore(tmp_path, identity, 10**9)
    engine = Engine(tiny, EngineConfig(page_size=16, kv_tokens=2048), store)
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    engine.submit([2] + [5] * 40, params, "a", cache_owner="chat-a")
    engine.submit([2] + [6] * 40, params, "b", cache_owner="chat-b")
    while engine._running or engine._waiting or not engine._commands.empty():
        engine.step()
    assert engine.has_work  # the finished conversations' pages wait to be saved
    engine.forget_cache_owner("chat-a")
    while engine.has_work:
        engine.step()
    engine.close()
    owners = [f.read_text().split() for f in store.folder.glob("??/*.owners")]
    assert owners and all(o == ["chat-b"] for o in owners)
