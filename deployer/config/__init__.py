"""deploy.yaml: the models, loading with line/column positions, and validation.

Use `load_config(path)` to get a validated `Config` (it raises `ConfigError` whose ``findings``
lists every problem) and `validate_file(path)` to get the findings without raising.
"""

from deployer.config.findings import Finding
from deployer.config.loader import load_config, validate_file
from deployer.config.models import (
    BUILTIN_SMOLLM2,
    AgentSettings,
    Config,
    Device,
    Fleet,
    Health,
    Hook,
    Hooks,
    Inventory,
    ModelSpec,
    Profile,
    QualityGate,
    Quantization,
    QuantOverride,
    Resources,
    Signing,
    Strategy,
)

__all__ = [
    "BUILTIN_SMOLLM2",
    "AgentSettings",
    "Config",
    "Device",
    "Finding",
    "Fleet",
    "Health",
    "Hook",
    "Hooks",
    "Inventory",
    "ModelSpec",
    "Profile",
    "QualityGate",
    "QuantOverride",
    "Quantization",
    "Resources",
    "Signing",
    "Strategy",
    "load_config",
    "validate_file",
]
