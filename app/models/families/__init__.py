"""One module per model family: how its files' hyperparameters and tensors map onto
`app.models.transformer`. Each exposes `config_from_gguf(gguf, shapes)`,
`config_from_hf(config)`, `gguf_tensors(cfg)` and `hf_tensors(cfg)`; `app.models.registry`
lists them."""
