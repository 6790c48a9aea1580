"""all-MiniLM-L6-v2 as a small torch module: text -> unit vectors of 384 floats.

A BERT encoder (6 layers, 12 heads of 32, GELU MLP of 1,536, post-LayerNorm), then mean
pooling over the real tokens and L2 normalisation -- what sentence-transformers computes
for this model (checked against its output on a fixture). Texts are cut at 256 word pieces,
the model's `max_seq_length`. The tokenizer is the folder's `tokenizer.json` run by
Hugging Face `tokenizers`.

Shapes: B texts, L word pieces (padded), d = 384, H = 12 heads of D = 32.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
import torch.nn.functional as F

from app.models.errors import ModelError

DIMENSIONS = 384
_BATCH = 32


class SentenceEncoder:
    def __init__(self, folder: Path, device: torch.device | str = "cpu"):
        from safetensors import safe_open
        from tokenizers import Tokenizer

        folder = Path(folder)
        config = json.loads((folder / "config.json").read_text())
        self.layers = int(config["num_hidden_layers"])
        self.heads = int(config["num_attention_heads"])
        self.eps = float(config.get("layer_norm_eps", 1e-12))
        bert = json.loads((folder / "sentence_bert_config.json").read_text()) \
            if (folder / "sentence_bert_config.json").is_file() else {}
        self.max_tokens = int(bert.get("max_seq_length", 256))
        self.device = torch.device(device)
        with safe_open(str(folder / "model.safetensors"), framework="pt", device="cpu") as f:
            self.w = {k: f.get_tensor(k).float().to(self.device) for k in f.keys()
                      if not k.startswith("pooler.") and k != "embeddings.position_ids"}
        if self.w["embeddings.word_embeddings.weight"].shape[1] != DIMENSIONS:
            raise ModelError("The document-search model is not all-MiniLM-L6-v2 (wrong width).")
        # Two copies: one cuts inputs at the model's limit, one counts whole texts.
        self.tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
        self.tokenizer.enable_truncation(self.max_tokens)
        self.tokenizer.no_padding()
        self._counter = Tokenizer.from_file(str(folder / "tokenizer.json"))
        self._counter.no_truncation()
        self._counter.no_padding()

    def count_tokens(self, text: str) -> int:
        """Word pieces of `text` without [CLS]/[SEP] and without truncation."""
        return len(self._counter.encode(text, add_special_tokens=False).ids)

    @torch.inference_mode()
    def encode(self, texts: list[str]) -> torch.Tensor:
        """[len(texts), 384] float32 unit vectors (rows in the order given)."""
        if not texts:
            return torch.empty(0, DIMENSIONS)
        encodings = self.tokenizer.encode_batch(list(texts))
        order = sorted(range(len(texts)), key=lambda i: len(encodings[i].ids))
        out = torch.empty(len(texts), DIMENSIONS)
        for start in range(0, len(order), _BATCH):
            rows = order[start:start + _BATCH]
            out[rows] = self._encode_batch([encodings[i].ids for i in rows]).cpu()
        return out

    def _encode_batch(self, id_lists: list[list[int]]) -> torch.Tensor:
        L = max(len(ids) for ids in id_lists)
        ids = torch.zeros(len(id_lists), L, dtype=torch.long)
        mask = torch.zeros(len(id_lists), L, dtype=torch.bool)
        for i, row in enumerate(id_lists):
            ids[i, :len(row)] = torch.tensor(row)
            mask[i, :len(row)] = True
        ids, mask = ids.to(self.device), mask.to(self.device)
        x = self._embed(ids)
        for layer in range(self.layers):
            x = self._layer(x, mask, f"encoder.layer.{layer}.")
        m = mask[..., None].float()
        pooled = (x * m).sum(1) / m.sum(1).clamp(min=1e-9)
        return F.normalize(pooled, p=2, dim=1)

    def _ln(self, x: torch.Tensor, prefix: str) -> torch.Tensor:
        return F.layer_norm(x, (x.shape[-1],), self.w[prefix + "weight"], self.w[prefix + "bias"], self.eps)

    def _dense(self, x: torch.Tensor, prefix: str) -> torch.Tensor:
        return F.linear(x, self.w[prefix + "weight"], self.w[prefix + "bias"])

    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        w = self.w
        positions = torch.arange(ids.shape[1], device=ids.device)
        x = (w["embeddings.word_embeddings.weight"][ids] + w["embeddings.position_embeddings.weight"][positions]
             + w["embeddings.token_type_embeddings.weight"][0])
        return self._ln(x, "embeddings.LayerNorm.")

    def _layer(self, x: torch.Tensor, mask: torch.Tensor, p: str) -> torch.Tensor:
        B, L, d = x.shape
        H, D = self.heads, d // self.heads

        def heads(t: torch.Tensor) -> torch.Tensor:  # [B, L, d] -> [B, H, L, D]
            return t.view(B, L, H, D).transpose(1, 2)

        q = heads(self._dense(x, p + "attention.self.query."))
        k = heads(self._dense(x, p + "attention.self.key."))
        v = heads(self._dense(x, p + "attention.self.value."))
        attn = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None, None, :],
                                              scale=1 / math.sqrt(D))
        attn = attn.transpose(1, 2).reshape(B, L, d)
        x = self._ln(x + self._dense(attn, p + "attention.output.dense."), p + "attention.output.LayerNorm.")
        h = F.gelu(self._dense(x, p + "intermediate.dense."))
        return self._ln(x + self._dense(h, p + "output.dense."), p + "output.LayerNorm.")
