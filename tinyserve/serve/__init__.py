"""The HTTP server: the aiohttp app and routes, request schemas and OpenAI-shaped errors, SSE
responses, auth / CORS middleware, Prometheus metrics."""
