"""OpenAI-compatible HTTP server (`dgemma serve`): wire format (protocol), routes and SSE (app), the engine's
worker thread (worker), admission and request glue (service), metrics, security, and the command. Importing this
package stays cheap; `dgemma.server.app.create_app` pulls in FastAPI."""
