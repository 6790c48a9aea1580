"""Documents bigger than the context: passages, embeddings, a persistent index, retrieval
with citations. No Qt here; the encoder needs torch, the index and splitter do not."""
