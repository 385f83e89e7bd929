"""Protocol buffers and their generated gRPC modules."""
