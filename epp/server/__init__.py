"""The serving edge: ext_proc gRPC server, request lifecycle, admin HTTP, composition root."""
