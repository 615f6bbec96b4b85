"""What the prefill and the decode node share: engine start-up, GPU placement, liveness,
metrics and the stats and info the router reads."""
