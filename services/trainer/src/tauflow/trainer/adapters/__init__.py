"""The trainer's wire side: its gRPC servicer, protobuf conversions, and one client per peer it calls."""
