"""Model weights and their provisioning (kept out of ``app/``: the service only resolves paths)."""
