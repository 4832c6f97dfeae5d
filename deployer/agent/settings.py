"""The agent's settings file, /etc/sits/agent.yaml: its pydantic model and a loader with file:line errors.

Every field has a default, so an empty file is a valid configuration. Unknown keys are refused:
a typo must not silently fall back to a default on a device nobody is watching. For example::

    host: 0.0.0.0            # beyond loopback: every route but /healthz, /readyz needs an API key
    port: 8080               # the admin surface (reload) is a unix socket, never this port
    max_concurrent: 4        # requests batched together on the model (the engine's KV-cache slots)
    queue_length: 16         # waiting for a slot beyond those; more: 429 + Retry-After
    max_tokens: 512
    swap_policy: auto        # side-by-side when MemAvailable holds both models, else unload-first
    adapter_memory_mb: 256   # LoRA adapters loaded at once; past it the least recently used unloads
    device: auto             # cuda when torch sees a CUDA device, else cpu (default: cpu)
    compile: auto            # torch engine: on compiles decode on a CPU too (minutes at first load)
    draft: off               # torch engine on a CPU: int4 drafts a lone greedy sequence's tokens
    kv_cache_type: auto      # torch engine: fp32 | fp16 | bf16 | int8 (CPU) KV cache; auto: fp32 on a CPU
    smoke_prompts:
      - prompt: "What is the capital of France?"
        expect: Paris
        max_tokens: 16
    latency_budget_ms: 5000
    max_connections: 256     # beyond it the longest-idle connection is closed for a new one
    allowed_hosts: [sits-box.local]   # keyless agent: Host names answered besides loopback ones
    tls_certfile: /etc/sits/tls/cert.pem   # both or neither: HTTPS
    tls_keyfile: /etc/sits/tls/key.pem
    fallback:                # an upstream model per request (docs/fallback.md)
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

import ipaddress
from pathlib import Path
from typing import Annotated, Literal

import yaml
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, model_validator
from pydantic_core import ErrorDetails

from deployer.core.memory import ADAPTER_BUDGET_MB
from deployer.core.yaml_words import on_off
from deployer.errors import ConfigError

__all__ = ["AgentSettings", "FallbackPolicy", "FallbackSettings", "SmokePrompt", "load_settings"]

DEFAULT_SETTINGS_PATH = Path("/etc/sits/agent.yaml")

FallbackPolicy = Literal["off", "on-trigger", "always"]
# A name as a Host header carries it, without the port: a DNS name or an IPv4 address.
HostName = Annotated[str, Field(min_length=1, max_length=253, pattern=r"^[A-Za-z0-9._-]+$")]


class FallbackSettings(BaseModel):
    """When and where the agent asks an upstream model instead of its own."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    base_url: str = Field(pattern=r"^https?://[^\s]+$", description="the upstream's /v1 URL")
    model: str = Field(min_length=1, description="the model name sent to the upstream")
    api_key_file: Path | None = Field(default=None, description="bearer key for the upstream (0600)")
    policy: FallbackPolicy = "on-trigger"
    deadline_ms: int | None = Field(default=300, ge=1, description="first-token deadline; null: off")
    min_confidence: float | None = Field(
        default=None, gt=0, lt=1, description="mean first-token probability below which: upstream; null: off"
    )
    confidence_tokens: int = Field(default=4, ge=1, le=64, description="tokens min_confidence averages")
    not_ready: bool = True
    overloaded: bool = True
    first_token_timeout_s: float = Field(default=10.0, gt=0, description="upstream: until its first token")
    read_timeout_s: float = Field(default=30.0, gt=0, description="upstream: between two tokens")
    latency_window: int = Field(default=3, ge=1, le=1000, description="upstream calls its P95 is over")
    breaker_failures: int = Field(default=3, ge=1, description="failures in a row that open the breaker")
    breaker_backoff_s: float = Field(default=5.0, gt=0, description="first open period; doubles")
    breaker_max_backoff_s: float = Field(default=300.0, gt=0)


class SmokePrompt(BaseModel):
    """A prompt a freshly loaded model must answer, within the latency budget, before it serves."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    prompt: str = Field(min_length=1)
    expect: str | None = Field(default=None, description="a substring the answer must contain")
    max_tokens: int = Field(default=8, ge=1, le=256)


class AgentSettings(BaseModel):
    """Everything `sits-agent serve` reads from agent.yaml."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    host: str = "127.0.0.1"
    port: int = Field(default=8080, ge=0, le=65535)
    max_concurrent: int = Field(default=4, ge=1, le=1024, description="requests batched together")
    queue_length: int = Field(default=16, ge=0, le=65536, description="requests waiting beyond those")
    max_request_bytes: int = Field(default=1 << 20, ge=1024)
    max_prompt_tokens: int = Field(default=1536, ge=1)
    max_tokens: int = Field(default=512, ge=1, description="the most tokens one request may generate")
    request_timeout_s: float = Field(
        default=120.0, gt=0, description="reading the body plus waiting for the model, per request"
    )
    # Connection limits (the HTTP server is uvicorn; these are the knobs it lacks or leaves open).
    max_connections: int = Field(default=256, ge=1, le=65536, description="open connections at once")
    listen_backlog: int = Field(default=512, ge=128, le=65535, description="connections not yet accepted")
    keep_alive_timeout_s: float = Field(default=5.0, gt=0, description="idle time between requests")
    header_timeout_s: float = Field(
        default=10.0, gt=0, description="absolute deadline for a request's headers, however they trickle"
    )
    max_header_bytes: int = Field(default=16384, ge=1024, le=1 << 20, description="request line + headers")
    stall_timeout_s: float = Field(
        default=30.0, gt=0, description="a client that reads nothing for this long is cancelled"
    )
    # Access.
    api_keys_file: Path | None = Field(
        default=None, description="hashed bearer keys; default <root>/etc/sits/api-keys"
    )
    allowed_hosts: tuple[HostName, ...] = Field(
        default=(),
        description="Host header names a keyless agent answers besides localhost, its loopback "
        "addresses and `host` (DNS rebinding: a web page must not reach the model)",
    )
    metrics_auth: Literal["api-key", "none"] = Field(
        default="api-key", description="/metrics: needs a key when the API does, or never"
    )
    admin_socket: Path | None = Field(
        default=None, description="the reload endpoint's unix socket; default <root>/run/sits/admin.sock"
    )
    tls_certfile: Path | None = None
    tls_keyfile: Path | None = None
    root: Path = Field(default=Path("/"), description="prefix of /etc/sits and /var/lib/sits")
    engine: Literal["torch", "llama.cpp"] = "torch"
    # cpu by default, as before "auto" existed: an agent.yaml written by hand (or by an older
    # controller) keeps running where it ran; the controller writes deploy.yaml's choice (auto).
    device: Literal["auto", "cpu", "cuda"] = Field(
        default="cpu", description="auto: cuda when torch sees a CUDA device, else cpu"
    )
    compile: Annotated[Literal["auto", "on", "off"], BeforeValidator(on_off)] = Field(
        default="auto",
        description="torch engine: compile decode with inductor; auto: on CUDA only (a CPU's first "
        "compile takes minutes and needs a C++ compiler)",
    )
    draft: Literal["off", "int4"] = Field(
        default="off",
        description="torch engine on a CPU: int4 decodes a lone greedy sequence speculatively, an "
        "int4 copy of the model (made at load) proposing tokens that one pass of the model checks",
    )
    kv_cache_type: Literal["auto", "fp32", "fp16", "bf16", "int8"] = Field(
        default="auto",
        description="torch engine: how the KV cache is stored (attention runs in fp32 on a CPU "
        "whatever it is); auto: fp32 on a CPU, the model's dtype on CUDA; int8: CPU only",
    )
    threads: int | None = Field(default=None, ge=1, description="torch intra-op threads; None: torch's")
    context_length: int = Field(default=2048, ge=16, description="cap on the engine's KV cache")
    smoke_prompts: tuple[SmokePrompt, ...] = (SmokePrompt(prompt="Hello"),)
    latency_budget_ms: int = Field(default=10_000, ge=1, description="per smoke prompt")
    readiness_timeout_s: float = Field(default=120.0, gt=0, description="load + warm-up + smoke")
    swap_policy: Literal["side-by-side", "unload-first", "auto"] = "auto"
    drain_timeout_s: float = Field(default=60.0, gt=0, description="unload-first: wait for in-flight")
    adapter_memory_mb: float = Field(
        default=ADAPTER_BUDGET_MB,
        gt=0,
        description="LoRA adapters loaded at once hold at most this (their factors in fp32); loading "
        "one past it unloads the least recently used",
    )
    fallback: FallbackSettings | None = Field(
        default=None, description="an upstream model to answer when this one cannot (docs/fallback.md)"
    )
    device_class: str | None = Field(
        default=None,
        min_length=1,
        description="deploy.yaml's profile of this device: an offline bundle must be for this class",
    )

    @model_validator(mode="after")
    def _prompt_fits_context(self) -> AgentSettings:
        if self.max_prompt_tokens >= self.context_length:
            raise ValueError(
                f"max_prompt_tokens ({self.max_prompt_tokens}) must be below context_length "
                f"({self.context_length}) to leave room for the answer"
            )
        return self

    @model_validator(mode="after")
    def _tls_pair(self) -> AgentSettings:
        if (self.tls_certfile is None) != (self.tls_keyfile is None):
            raise ValueError("tls_certfile and tls_keyfile go together: give both for HTTPS, or neither")
        return self

    @property
    def api_keys_path(self) -> Path:
        """Where the hashed API keys are read from."""
        return self.api_keys_file or self.root / "etc" / "sits" / "api-keys"

    @property
    def admin_socket_path(self) -> Path:
        """The unix socket of the admin surface (POST /admin/reload)."""
        return self.admin_socket or self.root / "run" / "sits" / "admin.sock"

    @property
    def loopback_only(self) -> bool:
        """The API listens on a loopback address only (no API key is required then)."""
        try:
            address = ipaddress.ip_address(self.host)
        except ValueError:
            return self.host == "localhost"
        return address.is_loopback

    @property
    def state_dir(self) -> Path:
        """<root>/var/lib/sits: versions, current/previous pointers, state.json."""
        return self.root / "var" / "lib" / "sits"


def load_settings(path: Path) -> AgentSettings:
    """Read and validate agent.yaml.

    Raises ConfigError listing every problem as `file:line: field: message`.
    """
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(
            f"{path}: cannot read the agent settings: {exc.strerror}",
            hint="create it (an empty file gives the defaults) or pass --config",
        ) from exc
    try:
        root_node = yaml.compose(text, Loader=yaml.SafeLoader)
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"{path}:{mark.line + 1}" if mark else str(path)
        raise ConfigError(f"{where}: not valid YAML: {exc}", hint="fix the syntax") from exc
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}:1: the settings must be a mapping of keys to values")
    try:
        return AgentSettings.model_validate(data)
    except ValidationError as exc:
        findings = [_finding(path, root_node, err) for err in exc.errors()]
        raise ConfigError(
            f"{path}: invalid agent settings:\n  " + "\n  ".join(findings),
            findings=findings,
            hint="see the field list in deployer/agent/settings.py",
        ) from exc


def _finding(path: Path, root_node: yaml.Node | None, err: ErrorDetails) -> str:
    loc = tuple(err.get("loc", ()))
    dotted = ".".join(str(part) for part in loc) or "(top level)"
    line = _line_of(root_node, loc)
    return f"{path}:{line}: {dotted}: {err.get('msg', 'invalid')}"


def _line_of(node: yaml.Node | None, loc: tuple) -> int:
    """The 1-based line where the field at `loc` is written (its key's line), else its nearest parent's."""
    line = node.start_mark.line + 1 if node is not None else 1
    for part in loc:
        found = _child(node, part)
        if found is None:
            break
        marker, node = found
        line = marker.start_mark.line + 1
    return line


def _child(node: yaml.Node | None, part: object) -> tuple[yaml.Node, yaml.Node] | None:
    """(the node that marks `part`'s position, the node holding its value) inside `node`."""
    if isinstance(node, yaml.MappingNode):
        for key, value in node.value:
            if key.value == str(part):
                return key, value
    if isinstance(node, yaml.SequenceNode) and isinstance(part, int) and part < len(node.value):
        return node.value[part], node.value[part]
    return None
