"""The HTTP edge shared by every route: `body.py` (reading and limiting JSON bodies),
`errors.py` (OpenAI-format errors), `sse.py` (server-sent events), `draining_server.py`
(graceful shutdown), `openapi.py` (request bodies in the OpenAPI document)."""
