"""Tandem internal API v1: code generated from the .proto files here by proto/generate.py."""
