"""The public gRPC service: validation, routing, prefill→decode orchestration."""
