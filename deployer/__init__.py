"""SITS-Deployer: declarative edge deployment and OTA updates for quantized LLMs."""

__version__ = "0.1.0"
