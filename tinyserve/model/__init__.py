"""The model: config.json parsing, the safetensors / dummy loader, GGUF import, the tokenizer and
chat template, `models/` (one file per family, HF parameter names) and `layers/`."""
