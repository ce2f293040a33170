"""weft.lang: the frontend DSL (gen, select, fork, roles) and its backends."""
