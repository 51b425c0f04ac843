"""Chat messages and tool calling (Gemma 4's native syntax and the JSON fallback), used by the Python API and the
server alike: pure functions of messages, tool schemas, token ids and text."""
