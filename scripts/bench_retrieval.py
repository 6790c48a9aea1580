#!/usr/bin/env python3
"""Retrieval quality and speed on public long documents: the CPython licence text and the
documentation of a dozen standard-library modules (as `pydoc` renders it), with 34 written
questions, each with a phrase that only the passage answering it contains.

Prints recall@5 (a question counts when one of its top 5 passages holds the phrase), the
indexing time and size in encoder tokens, the time to reuse the index, and per-question
retrieval latency. Targets: recall@5 >= 0.9, 50,000 tokens indexed in <= 60 s, retrieval
<= 100 ms.

    python scripts/bench_retrieval.py [--json]
"""

from __future__ import annotations

import argparse
import importlib
import json
import pydoc
import statistics
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

MODULES = ("json", "textwrap", "shutil", "heapq", "bisect", "functools", "itertools",
           "collections", "re", "argparse", "datetime", "pathlib")

QUESTIONS = [
    ("Who created Python and where?", "Guido van Rossum at Stichting"),
    ("When was the Python Software Foundation formed?", "In 2001, the Python Software Foundation"),
    ("Which releases were owned by which organisation, and were they GPL-compatible?", "Derived     Year"),
    ("Why does Richard Stallman say 1.6.1 is not GPL-compatible?", "choice of law clause"),
    ("Since which Python version are documentation examples also under the Zero-Clause BSD license?",
     "Starting with Python 3.8.6"),
    ("What is the address of BeOpen's office?", "160 Saratoga Avenue"),
    ("When does the PSF license agreement terminate?", "automatically terminate upon a material"),
    ("May a licensee use PSF trademarks to promote its products?", "does not grant permission to use PSF"),
    ("Which state's law governs the CNRI license agreement?", "Commonwealth of Virginia"),
    ("What must a licensee include when it distributes a derivative work of Python?", "brief summary of"),
    ("Which company did the PythonLabs team move to in October 2000?", "Digital Creations"),
    ("Where is the Corporation for National Research Initiatives?", "Reston, Virginia"),
    ("How do I get the total, used and free space of a disk?", "Return disk usage statistics"),
    ("How can I remove common leading whitespace from a block of text?", "Remove any common leading whitespace"),
    ("Which function pushes an item on a heap and then pops the smallest one?",
     "Push item on the heap, then pop and return the smallest"),
    ("How do I insert an item into a sorted list and keep it sorted?", "Insert item x in list a, and keep it sorted"),
    ("Which decorator caches the results of recent calls of a function?", "Least-recently-used cache decorator"),
    ("How can I shorten a text so that it fits in a given width?", "Collapse and truncate the given text"),
    ("How can I group consecutive items of an iterable by a key?", "groupby(iterable[, keyfunc])"),
    ("How do I create a tuple subclass with named fields?", "Returns a new subclass of tuple with named fields"),
    ("How do I copy a whole directory tree?", "Recursively copy a directory tree"),
    ("How do I find the path of an executable command?", "which(cmd"),
    ("How do I move a file or a directory somewhere else?", "move a file or directory to another location"),
    ("How can I create a zip or tar archive of a folder?", "make_archive"),
    ("How do I escape special characters in a regular expression?", "Escape special characters"),
    ("How do I compile a regular expression into a pattern object?", "Compile a regular expression pattern"),
    ("How do I split a string by a regular expression?", "Split the source string by the occurrences"),
    ("How do I turn a list into a heap in place?", "Transform list into a heap"),
    ("How do I find the n largest elements of a dataset?", "Find the n largest"),
    ("Which class decorator fills in the missing comparison methods?", "Class decorator that fills in missing ordering"),
    ("What does ensure_ascii do when encoding JSON?", "If ensure_ascii is"),
    ("How do I make a regular expression match regardless of case?", "IGNORECASE"),
    ("How can json.loads call a function on every decoded JSON object?", "object_hook"),
    ("How do I parse command-line options and print help automatically?", "ArgumentParser"),
]


def write_corpus(folder: Path) -> list[Path]:
    licence = Path(sysconfig.get_paths()["stdlib"]) / "LICENSE.txt"
    docs = [f"# Module {name}\n\n" + pydoc.render_doc(importlib.import_module(name), renderer=pydoc.plaintext)
            for name in MODULES]
    paths = [folder / "LICENSE.txt", folder / "stdlib-docs.md"]
    paths[0].write_text(licence.read_text(encoding="utf-8"), encoding="utf-8")
    paths[1].write_text("\n\n".join(docs), encoding="utf-8")
    return paths


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    import torch

    from app.retrieval.library import DocumentLibrary

    work = Path(tempfile.mkdtemp(prefix="ferrox-retrieval-"))
    paths = write_corpus(work)
    corpus = "\n".join(p.read_text() for p in paths)
    missing = [phrase for _, phrase in QUESTIONS if phrase not in corpus]
    library = DocumentLibrary(work / "index.sqlite3", work / "models")
    encoder = library.encoder  # load outside the timed indexing
    tokens = sum(encoder.count_tokens(p.read_text()) for p in paths)
    started = time.perf_counter()
    doc_ids = [library.index_file(p) for p in paths]
    index_s = time.perf_counter() - started
    passages = library.index.db.execute("SELECT count(*) FROM passages").fetchone()[0]
    started = time.perf_counter()
    assert [library.index_file(p) for p in paths] == doc_ids
    reuse_s = time.perf_counter() - started
    library.retrieve("warm up", doc_ids)
    hits, latencies, misses = 0, [], []
    for question, phrase in QUESTIONS:
        started = time.perf_counter()
        found = library.retrieve(question, doc_ids, k=5)
        latencies.append((time.perf_counter() - started) * 1000)
        if any(phrase in r.passage.passage.text for r in found):
            hits += 1
        else:
            misses.append(question)
    library.close()
    result = {
        "cpu_capability": torch.backends.cpu.get_cpu_capability(), "threads": torch.get_num_threads(),
        "questions": len(QUESTIONS), "recall_at_5": round(hits / len(QUESTIONS), 3),
        "corpus_tokens": tokens, "passages": passages, "index_s": round(index_s, 2),
        "tokens_per_s": round(tokens / index_s), "reuse_index_s": round(reuse_s, 3),
        "retrieval_ms_p50": round(statistics.median(latencies), 1),
        "retrieval_ms_max": round(max(latencies), 1), "missed": misses,
        "phrases_not_in_corpus": missing,
    }
    if args.json:
        print(json.dumps(result))
        return
    for key, value in result.items():
        print(f"{key:>22}: {value}")


if __name__ == "__main__":
    main()
