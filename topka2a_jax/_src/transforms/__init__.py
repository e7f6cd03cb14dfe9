"""The optax transforms: the exchange with error feedback, and what wraps it."""
