"""agent.yaml: defaults, strict keys, and errors that point at file:line."""

from pathlib import Path

import pytest

from deployer.agent.settings import AgentSettings, load_settings
from deployer.errors import ConfigError


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "agent.yaml"
    path.write_text(text)
    return path


def test_empty_file_gives_the_documented_defaults(tmp_path):
    settings = load_settings(_write(tmp_path, ""))
    assert settings == AgentSettings()
    assert settings.max_concurrent == 4
    assert settings.swap_policy == "auto"
    assert settings.state_dir == Path("/var/lib/sits")


def test_values_are_read(tmp_path):
    text = (
        "host: 0.0.0.0\nport: 9000\nmax_concurrent: 2\nqueue_length: 3\nroot: /srv/dev1\n"
        "swap_policy: unload-first\nsmoke_prompts:\n  - prompt: Hi\n    expect: H\n    max_tokens: 4\n"
    )
    settings = load_settings(_write(tmp_path, text))
    assert (settings.host, settings.port, settings.max_concurrent, settings.queue_length) == (
        "0.0.0.0",
        9000,
        2,
        3,
    )
    assert settings.state_dir == Path("/srv/dev1/var/lib/sits")
    assert settings.smoke_prompts[0].expect == "H"
    assert settings.swap_policy == "unload-first"


def test_unknown_key_names_its_line(tmp_path):
    path = _write(tmp_path, "port: 9000\nmax_concurent: 2\n")
    with pytest.raises(ConfigError) as info:
        load_settings(path)
    assert info.value.findings == [f"{path}:2: max_concurent: Extra inputs are not permitted"]


def test_nested_bad_value_names_its_line(tmp_path):
    path = _write(tmp_path, "smoke_prompts:\n  - prompt: Hi\n  - prompt: Yo\n    max_tokens: 0\n")
    with pytest.raises(ConfigError) as info:
        load_settings(path)
    (finding,) = info.value.findings
    assert finding.startswith(f"{path}:4: smoke_prompts.1.max_tokens:")


def test_every_problem_is_listed(tmp_path):
    path = _write(tmp_path, "port: -1\nswap_policy: sometimes\n")
    with pytest.raises(ConfigError) as info:
        load_settings(path)
    lines = sorted(f.split(": ")[0] for f in info.value.findings)
    assert lines == [f"{path}:1", f"{path}:2"]


def test_prompt_limit_must_leave_room_in_the_context(tmp_path):
    with pytest.raises(ConfigError, match="max_prompt_tokens"):
        load_settings(_write(tmp_path, "context_length: 256\nmax_prompt_tokens: 256\n"))


def test_bad_yaml_names_its_line(tmp_path):
    path = _write(tmp_path, "port: 9000\nhost: [unclosed\n")
    with pytest.raises(ConfigError, match=r"agent.yaml:\d+: not valid YAML"):
        load_settings(path)


def test_not_a_mapping_and_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="mapping"):
        load_settings(_write(tmp_path, "- a\n- b\n"))
    with pytest.raises(ConfigError, match="cannot read"):
        load_settings(tmp_path / "absent.yaml")


def test_device_is_read_and_a_bad_one_names_its_line(tmp_path):
    assert load_settings(_write(tmp_path, "device: auto\n")).device == "auto"
    # Without the key an agent runs where it ran before `auto` existed; the controller always writes it.
    assert AgentSettings().device == "cpu"
    path = _write(tmp_path, "port: 9000\ndevice: gpu\n")
    with pytest.raises(ConfigError) as info:
        load_settings(path)
    (finding,) = info.value.findings
    assert finding.startswith(f"{path}:2: device: Input should be 'auto', 'cpu' or 'cuda'")


def test_compile_defaults_to_auto_and_a_bad_one_names_its_line(tmp_path):
    assert AgentSettings().compile == "auto"
    # YAML 1.1 reads a bare on/off as true/false; they mean the words written.
    assert load_settings(_write(tmp_path, "compile: on\n")).compile == "on"
    assert load_settings(_write(tmp_path, "compile: off\n")).compile == "off"
    assert load_settings(_write(tmp_path, "compile: 'on'\n")).compile == "on"
    path = _write(tmp_path, "port: 9000\ncompile: sometimes\n")
    with pytest.raises(ConfigError) as info:
        load_settings(path)
    (finding,) = info.value.findings
    assert finding.startswith(f"{path}:2: compile: Input should be 'auto', 'on' or 'off'")
