"""`python -m app ask`: index documents (or reuse their index), retrieve, answer with
citations -- the same code the window uses, printed as one JSON object."""

from __future__ import annotations

import time
from pathlib import Path

from app.retrieval.answer import cited_numbers, question_prompt
from app.retrieval.library import DocumentLibrary

INDEX_FILE = "retrieval.sqlite3"


def open_library(data_dir: Path, models_dir: Path) -> DocumentLibrary:
    return DocumentLibrary(Path(data_dir) / INDEX_FILE, models_dir)


def ask(doc_paths: list[Path], question: str, *, data_dir: Path, models_dir: Path,
        model_path: Path, device: str = "auto", dtype: str = "auto", k: int = 5,
        max_tokens: int = 256) -> dict:
    from app.engine.device import load_on
    from app.engine.generate import generate
    from app.engine.sampling import SamplingParams
    from app.models.chat_template import Message, encode_chat

    library = open_library(data_dir, models_dir)
    try:
        started = time.perf_counter()
        doc_ids = [library.index_file(p) for p in doc_paths]
        index_s = time.perf_counter() - started
        started = time.perf_counter()
        retrieved = library.retrieve(question, doc_ids, k)
        retrieve_ms = (time.perf_counter() - started) * 1000
    finally:
        library.close()
    loaded = load_on(model_path, device, dtype)
    prompt = encode_chat(loaded.tokenizer, loaded.template, [Message("user", question_prompt(question, retrieved))])
    result = generate(loaded, prompt, SamplingParams(max_tokens=max_tokens, temperature=0))
    return {
        "question": question,
        "answer": result.text,
        "cited": cited_numbers(result.text, retrieved),
        "passages": [{"number": r.number, "file": r.passage.document_name, "page": r.passage.passage.page,
                      "heading": r.passage.passage.heading, "score": round(r.score, 5),
                      "text": r.passage.passage.text} for r in retrieved],
        "timings": {"index_s": round(index_s, 3), "retrieve_ms": round(retrieve_ms, 2),
                    "load_s": round(loaded.load_seconds, 3), "prefill_s": round(result.prefill_seconds, 3),
                    "decode_tokens_per_s": round(result.decode_tokens_per_s, 2)},
        "model": loaded.name,
    }
