"""The controller's wire: the gRPC clients of the roles it follows (one module per peer), their protobuf
conversions, the contract check of each role, the health check, and the ControllerService servicer."""
