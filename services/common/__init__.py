"""Helpers shared by every gRPC service: server start-up, health, reflection, error mapping."""
