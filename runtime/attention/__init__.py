"""weft.runtime.attention: attention backends behind one interface, chosen by name."""
