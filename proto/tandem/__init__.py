"""Tandem's internal gRPC API (generated code lives in the versioned subpackages)."""
