"""Edge-cloud fallback: per request, the device's model or an upstream OpenAI-compatible one.

    settings.py  agent.yaml's `fallback:` section
    source.py    FallbackSource, the TokenSource that decides per request (the policy, the triggers)
    upstream.py  the upstream client (httpx) and its answers as generations
    breaker.py   the circuit breaker in front of the upstream
    window.py    the upstream's recent latencies (P95) and the recent fallbacks
    metrics.py   the fallback's Prometheus metrics

See docs/fallback.md.
"""
