"""weft.runtime.http: the HTTP server (SGLang's native API, the OpenAI API, metrics)."""
