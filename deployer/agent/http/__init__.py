"""The agent's HTTP surface: the server, its routes, OpenAI schemas, admission and metrics."""
