"""The decode actor: the engine in decode role with speculation, streaming tokens."""
