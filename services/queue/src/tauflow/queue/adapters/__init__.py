"""The queue's wire side: the gRPC servicer, protobuf conversion and fast paths, and the external port."""
