"""weft.runtime: the serving runtime (scheduler, model runner, memory, detokenizer, engine)."""
