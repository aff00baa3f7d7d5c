"""The engine core and the one interface services reach it through (`client.EngineClient`):
commands in, one message per step out (`messages`), the loop that owns the engine (`loop`),
in a process of its own for workers (`process`)."""
