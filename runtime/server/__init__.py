"""weft.runtime.server: the front of a runtime: the in-process Engine, the HTTP server, the tokenizer manager and the detokenizer."""
