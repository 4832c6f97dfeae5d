"""Code both sides need: hashing, canonical JSON, bounded file parsing, manifests, the quantized
weight layout, verification.

Everything under `deployer.core` imports only the standard library and the agent's own
dependencies (no paramiko, no jinja2, no click), so the device agent can use it.
"""
