"""API keys and TLS with the official openai client: keys required beyond loopback or once listed,
refusals in the OpenAI shape and counted, keys never logged; HTTPS with a self-signed certificate."""

from __future__ import annotations

import datetime
import ipaddress
import logging
import secrets
import ssl

import openai
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from deployer.agent.http.auth import hash_key, load_keyring
from deployer.errors import ConfigError

MESSAGES = [{"role": "user", "content": "Hi"}]
LOOPBACK = ipaddress.ip_address("127.0.0.1")


@pytest.fixture
def key(short_dir):
    """A fresh key, listed (hashed) in the device's api-keys file."""
    value = secrets.token_urlsafe(32)
    path = short_dir / "api-keys"
    path.write_text(f"# written by sits-deployer\n{hash_key(value)}\n")
    return value, path


def _self_signed(directory):
    private = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "sits-agent test")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(private.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(hours=1))
        .add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), False
        )
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), True)
        .sign(private, hashes.SHA256())
    )
    cert_path, key_path = directory / "cert.pem", directory / "key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        private.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
    )
    return cert_path, key_path


def test_keys_are_enforced_counted_and_never_logged(start_agent, key, model_name, http, caplog):
    value, path = key
    caplog.set_level(logging.DEBUG)
    agent = start_agent(api_keys_file=path)
    base = f"http://127.0.0.1:{agent.port}/v1"
    good = openai.OpenAI(base_url=base, api_key=value, max_retries=0)
    answer = good.chat.completions.create(model=model_name, messages=MESSAGES, max_tokens=2)
    assert answer.choices[0].message.role == "assistant"
    for wrong in ("not-" + value, value[:-1]):
        client = openai.OpenAI(base_url=base, api_key=wrong, max_retries=0)
        with pytest.raises(openai.AuthenticationError) as info:
            client.chat.completions.create(model=model_name, messages=MESSAGES, max_tokens=2)
        assert info.value.status_code == 401
        assert info.value.body["code"] == "invalid_api_key"
    status, headers, body = http(agent.port, "GET", "/v1/models")  # no Authorization header
    assert (status, set(body["error"])) == (401, {"message", "type", "param", "code"})
    assert headers["www-authenticate"] == "Bearer"
    assert http(agent.port, "GET", "/metrics")[0] == 401
    assert http(agent.port, "GET", "/healthz")[0] == 200
    assert http(agent.port, "GET", "/readyz")[0] == 200
    assert agent.metrics.value("sits_auth_failures_total", reason="invalid") == 2
    assert agent.metrics.value("sits_auth_failures_total", reason="missing") == 2
    assert value not in caplog.text and value[:-1] not in caplog.text


def test_metrics_can_be_left_open(start_agent, key, http):
    agent = start_agent(api_keys_file=key[1], metrics_auth="none")
    assert http(agent.port, "GET", "/metrics")[0] == 200
    assert http(agent.port, "GET", "/v1/models")[0] == 401


def test_beyond_loopback_without_keys_refuses_to_start(start_agent, short_dir):
    with pytest.raises(ConfigError, match="lists no API key"):
        start_agent(host="0.0.0.0", api_keys_file=short_dir / "absent")


def test_malformed_key_file_names_the_line_not_the_content(short_dir):
    path = short_dir / "bad-keys"
    path.write_text("sha256:" + "0" * 64 + "\nmy-plaintext-secret\n")
    with pytest.raises(ConfigError) as info:
        load_keyring(path, required=True)
    assert ":2:" in info.value.message
    assert "my-plaintext-secret" not in str(info.value)


def test_openai_client_over_tls_with_and_without_a_key(start_agent, short_dir, key, model_name):
    cert, private = _self_signed(short_dir)
    for keys_file, api_key in ((short_dir / "no-keys", "unused"), (key[1], key[0])):
        agent = start_agent(tls_certfile=cert, tls_keyfile=private, api_keys_file=keys_file)
        client = openai.OpenAI(
            base_url=f"https://127.0.0.1:{agent.port}/v1",
            api_key=api_key,
            max_retries=0,
            http_client=openai.DefaultHttpxClient(verify=ssl.create_default_context(cafile=str(cert))),
        )
        streamed = client.chat.completions.create(
            model=model_name, messages=MESSAGES, max_tokens=3, temperature=0, stream=True
        )
        assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices)
        plain = openai.OpenAI(base_url=f"http://127.0.0.1:{agent.port}/v1", api_key=api_key, max_retries=0)
        with pytest.raises(openai.APIConnectionError):
            plain.models.list()
