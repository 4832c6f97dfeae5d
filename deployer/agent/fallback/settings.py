"""agent.yaml's `fallback:` section: the upstream model, the policy and its triggers.

fallback:
  base_url: http://10.0.0.5:8080/v1      # any OpenAI-compatible API (another sits-agent too)
  model: smollm2-360m                     # the name the upstream serves
  api_key_file: /etc/sits/secrets/fallback-key   # mode 0600; its first line is the bearer key
  policy: on-trigger                      # off | on-trigger | always
  deadline_ms: 300                        # first token later than this: ask the upstream
  min_confidence: 0.6                     # mean probability of the first tokens below this: ask it
  confidence_tokens: 4                    # how many first tokens (a stream holds them back)
  not_ready: true                         # no model loaded (loading, load failed)
  overloaded: true                        # the queue is full, or the engine ran out of memory
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

__all__ = ["FallbackSettings", "Policy"]

Policy = Literal["off", "on-trigger", "always"]


class FallbackSettings(BaseModel):
    """When and where the agent asks an upstream model instead of its own."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    base_url: str = Field(pattern=r"^https?://[^\s]+$", description="the upstream's /v1 URL")
    model: str = Field(min_length=1, description="the model name sent to the upstream")
    api_key_file: Path | None = Field(default=None, description="bearer key for the upstream (0600)")
    policy: Policy = "on-trigger"
    deadline_ms: int | None = Field(default=300, ge=1, description="first-token deadline; null: off")
    min_confidence: float | None = Field(
        default=None, gt=0, lt=1, description="mean first-token probability below which: upstream; null: off"
    )
    confidence_tokens: int = Field(default=4, ge=1, le=64, description="tokens min_confidence averages")
    not_ready: bool = True
    overloaded: bool = True
    first_token_timeout_s: float = Field(default=10.0, gt=0, description="upstream: until its first token")
    read_timeout_s: float = Field(default=30.0, gt=0, description="upstream: between two chunks")
    latency_window: int = Field(default=3, ge=1, le=1000, description="upstream calls its P95 is over")
    breaker_failures: int = Field(default=3, ge=1, description="failures in a row that open the breaker")
    breaker_backoff_s: float = Field(default=5.0, gt=0, description="first open period; doubles")
    breaker_max_backoff_s: float = Field(default=300.0, gt=0)
