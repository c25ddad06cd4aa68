"""The rollout service's wire side: the gRPC servicer, protobuf <-> domain conversions, and one client per
peer (the queue, the reward service, the weight sidecar) implementing the ports of ``tauflow.rollout.ports``."""
