"""gRPC plumbing shared by the services: server lifecycle, error mapping, channels."""
