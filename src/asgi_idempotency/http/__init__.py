"""HTTP: the middleware, request reading, the responder, fingerprint, policy, principals."""
