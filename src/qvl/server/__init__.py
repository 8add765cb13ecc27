"""`qvl serve`: an OpenAI-compatible HTTP API and an offline web page over one engine.

app (routes) -> openai (chat completions) -> worker (the one engine thread) -> Engine.
"""
