"""The prefill actor: the engine in prefill role, shipping KV blocks to a decode actor."""
