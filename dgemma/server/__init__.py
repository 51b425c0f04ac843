"""OpenAI-compatible HTTP server (`dgemma serve`): wire format (protocol: requests, responses), routes and SSE
(app), the engine's worker thread (worker), loading and admission (service), requests checked and planned into
engine work (planning), engine events back to deltas (generation), metrics, security, and the command. Importing
this package stays cheap; `dgemma.server.app.create_app` pulls in FastAPI."""
