"""weft.constrain: grammars (JSON schema, regex, choices) compiled to token masks."""
