"""The gateway's routes, one module per endpoint family, each an ``APIRouter`` over the app's
shared state (``services.gateway.state.Gateway``)."""
