"""The coordinator: launch or connect Ray, accept requests, dispatch, gather, scale (planned)."""
