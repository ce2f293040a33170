"""weft.runtime.server.http: the HTTP server (SGLang's native API, the OpenAI API, metrics)."""
