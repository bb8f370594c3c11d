"""The public gRPC API (magicserve/v1/*.proto) and its generated stubs."""
