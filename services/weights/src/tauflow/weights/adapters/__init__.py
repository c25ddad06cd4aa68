"""The sidecar's wire side: the gRPC servicer, protobuf conversion, and the client of the rollout servers."""
