"""The tandem Python SDK (gRPC; depends only on grpcio and protobuf)."""
