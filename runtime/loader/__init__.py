"""weft.runtime.loader: model files (HF folder, GGUF, packaged default) and weight iteration."""
