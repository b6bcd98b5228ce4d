"""The engine client: how the event loop reaches the engine thread. `client.py` (EngineClient:
submit, abort, snapshot), `loop.py` (the engine thread's loop), `commands.py` (what crosses
between them), `admission.py` (queue limits, 429/503), `request_group.py` (one HTTP request's
engine requests), `exchange.py` (groups released when an HTTP exchange ends)."""
