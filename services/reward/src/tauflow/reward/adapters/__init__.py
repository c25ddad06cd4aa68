"""The reward service's wire side: the gRPC servicer and the protobuf <-> domain conversions."""
