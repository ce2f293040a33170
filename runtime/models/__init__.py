"""weft.runtime.models: our torch modules for supported architectures."""
