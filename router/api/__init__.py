"""The OpenAI HTTP surface: the app, its routes, request schemas and validation, responses and
SSE, and the middleware in front of them (auth, access log, overload gate, drain)."""
