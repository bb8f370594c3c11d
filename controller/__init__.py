"""Control plane: configuration, Ray placement, request routing, gRPC server and the CLI."""
