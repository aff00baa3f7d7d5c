"""Router: picks prefill and decode workers for each request and streams tokens back."""
