"""Moving KV blocks between engines: the Transport interface and its implementations."""
