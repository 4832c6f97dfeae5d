"""Fixtures every test area shares: the seeded tiny checkpoint and the real demo model."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from deployer.build.demo_model import make_tiny_checkpoint, prepare_smollm2
from deployer.core.kernel_cache import KERNEL_CACHE_VARIABLE, shared_kernel_cache
from deployer.core.redact import redaction_scope
from tests.checkpoints import hf_random_checkpoint

# Our CPU kernel (engines/torch/native.py) is built once per machine into the project's cache, not once
# per agent store a test makes (an agent points the variable at its store only when it is unset).
os.environ.setdefault(KERNEL_CACHE_VARIABLE, str(shared_kernel_cache()))

# The device lab (session-scoped, one per machine): loaded once here for every test folder.
pytest_plugins = ["tests.lab.fixtures"]


@pytest.fixture(autouse=True)
def _own_secrets() -> Iterator[None]:
    """Secrets a test registers (a config's ${VAR} values) are forgotten after it, so another
    test's output is never redacted with them."""
    with redaction_scope():
        yield


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A seeded 2-layer Llama checkpoint (fp32 safetensors + BPE tokenizer). Treat as read-only."""
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny-model"), seed=0)


@pytest.fixture(scope="session")
def tiny_model_dir_b(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Same architecture as `tiny_model_dir`, other weights (seed 1): a 'v2'. Read-only."""
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny-model-b"), seed=1)


@pytest.fixture(scope="session")
def varied_model_dir(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Path:
    """A seeded random transformers Llama whose wide initialisation (std 0.3) makes greedy
    decoding wander over many tokens with clear margins (the trained-looking tiny checkpoint
    repeats one token), so 128-token comparisons mean something."""
    import json

    from transformers import AutoConfig

    vocab = json.loads((tiny_model_dir / "config.json").read_text())["vocab_size"]
    config = AutoConfig.for_model(
        "llama",
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        initializer_range=0.3,
        tie_word_embeddings=False,
    )
    return hf_random_checkpoint(tmp_path_factory.mktemp("varied-model"), config, tiny_model_dir)


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """SmolLM2-135M-Instruct in HF layout, prepared once and cached under ~/.cache/sits-deployer."""
    return prepare_smollm2()


# What a fixture implies about a test's cost, applied as markers at collection, so that a new test
# that takes the real model, the lab or nginx is never counted in the fast tier (scripts/test.sh
# --fast deselects these markers and `long`, which costly tests say themselves).
_MARKER_OF_FIXTURE = {"smollm2_dir": "slow", "lab": "lab", "nginx": "nginx"}


# Tests measured to cost many seconds each without the model, the lab or nginx (agents started and
# stopped, torch.compile, the llama.cpp engine, timeouts that must pass): a file, a test (all its
# parameters) or one parametrization. Measured with the fast tier on 2 shared cores (a wall time
# of 4 s or more, or 2 s of CPU). An entry that no longer names a test stops the run.
LONG = (
    "tests/agent/engines/llamacpp/test_decoding_controls.py::test_both_engines_write_json_that_validates_and_agree[enum]",
    "tests/agent/engines/torch/test_batched.py::test_a_background_compile_serves_eager_steps_until_the_compiled_step_is_ready",
    "tests/agent/engines/torch/test_batched.py::test_an_engine_with_compile_off_runs_eager_layers_on_a_model_compiled_before",
    "tests/agent/engines/torch/test_batched.py::test_compiled_decode_layers_give_the_eager_logits_bit_for_bit_in_bf16",
    "tests/agent/engines/torch/test_batched.py::test_the_compiled_cpu_step_gives_the_eager_tokens_alone_and_batched",
    "tests/agent/engines/torch/test_native_kernels.py::test_a_library_built_elsewhere_loads_where_there_is_no_compiler",
    "tests/agent/engines/torch/test_native_kernels.py::test_the_kernels_match_the_dequantized_weights[1-int4-64-64-32-dtype0]",
    "tests/agent/engines/torch/test_speculative.py::test_greedy_tokens_are_the_models_own_for_128_tokens",
    "tests/agent/engines/torch/test_speculative.py::test_with_compiled_steps_and_draft_the_tokens_stay_the_models",
    "tests/agent/http/test_admin.py::test_sits_agent_reload_finds_the_socket_from_agent_yaml",
    "tests/agent/http/test_auth_tls.py::test_openai_client_over_tls_with_and_without_a_key",
    "tests/agent/http/test_fatal_exit.py::test_an_event_loop_that_stops_answering_exits_non_zero",
    "tests/agent/http/test_http_faults.py::test_50_clients_for_a_minute_get_answers_or_deliberate_429s",
    "tests/agent/http/test_openai_clients.py::test_forced_tool_choice_always_calls_the_tool[llama.cpp-named]",
    "tests/agent/http/test_openai_clients.py::test_json_object_is_an_object[llama.cpp]",
    "tests/agent/http/test_openai_clients.py::test_langchain_bind_tools_with_a_named_choice[llama.cpp]",
    "tests/agent/http/test_openai_clients.py::test_langchain_structured_output_and_stream[llama.cpp]",
    "tests/agent/http/test_openai_clients.py::test_parse_returns_the_pydantic_model[llama.cpp]",
    "tests/agent/http/test_openai_clients.py::test_sampled_named_calls_always_parse[llama.cpp]",
    "tests/agent/http/test_openai_clients.py::test_tool_call_deltas_stream_the_same_call[llama.cpp]",
    "tests/agent/http/test_openai_clients.py::test_tool_results_round_trip_through_the_template[llama.cpp]",
    "tests/agent/http/test_openai_clients.py::test_twenty_schemas_always_validate[llama.cpp]",
    "tests/agent/http/test_server_api.py::test_completions_plain_and_streamed",
    "tests/agent/http/test_server_api.py::test_health_ready_and_metrics",
    "tests/agent/http/test_server_api.py::test_models_lists_active_then_previous",
    "tests/agent/http/test_server_api.py::test_stop_string_cuts_the_answer",
    "tests/agent/http/test_server_api.py::test_suffix_fills_in_the_middle_where_the_model_has_fim_tokens",
    "tests/agent/http/test_server_errors.py::test_absurd_bodies_are_400",
    "tests/agent/http/test_server_errors.py::test_client_leaving_mid_stream_frees_its_slot",
    "tests/agent/http/test_server_errors.py::test_malformed_json",
    "tests/agent/http/test_server_errors.py::test_max_tokens_beyond_limits",
    "tests/agent/http/test_server_errors.py::test_model_names",
    "tests/agent/http/test_server_errors.py::test_over_capacity_is_429_with_retry_after",
    "tests/agent/http/test_server_errors.py::test_oversized_body",
    "tests/agent/http/test_server_errors.py::test_oversized_prompt",
    "tests/agent/http/test_server_errors.py::test_seed_beyond_64_bits_is_400",
    "tests/agent/http/test_server_errors.py::test_server_still_answers_after_bad_input",
    "tests/agent/http/test_server_errors.py::test_unknown_fields_are_ignored_logged_once_and_counted",
    "tests/agent/http/test_server_errors.py::test_unknown_route_and_wrong_method",
    "tests/agent/http/test_systemd_lifecycle.py",
    "tests/agent/ota/test_agent_cli.py::test_install_reload_rollback_through_a_running_server",
    "tests/agent/ota/test_agent_cli.py::test_install_status_rollback_gc_without_a_server",
    "tests/agent/ota/test_bundle.py::test_the_bundle_command_carries_the_agents_wheels_and_install_from_upgrades_the_agent",
    "tests/agent/ota/test_crash_safety.py::test_kill_at_each_step[recovered]",
    "tests/agent/ota/test_crash_safety.py::test_kill_at_each_step[staged]",
    "tests/agent/ota/test_crash_safety.py::test_kill_at_each_step[verified]",
    "tests/agent/ota/test_crash_safety.py::test_kill_at_random_instants",
    "tests/agent/runtime/test_hotswap.py::test_broken_artifact_is_refused_and_the_old_keeps_serving",
    "tests/agent/runtime/test_hotswap.py::test_rollback_reloads_are_counted",
    "tests/agent/runtime/test_hotswap.py::test_unload_first_failure_restores_the_old_model",
    "tests/agent/runtime/test_hotswap.py::test_unload_first_gap_answers_503_then_serves_the_new_model",
    "tests/agent/runtime/test_scheduler.py::test_an_abandoned_generation_frees_its_slot[torch]",
    "tests/agent/runtime/test_scheduler_http.py::test_a_request_whose_grammar_refuses_fails_alone_beside_streams",
    "tests/agent/runtime/test_scheduler_http.py::test_concurrent_streams_answer_as_one_stream_alone",
    "tests/agent/runtime/test_scheduler_http.py::test_swaps_under_16_streaming_clients_fail_no_request[torch]",
    "tests/agent/serving/test_fallback.py::test_a_late_first_token_goes_upstream_and_a_stream_never_mixes",
    "tests/agent/serving/test_fallback.py::test_a_sure_device_keeps_the_answer_and_shows_no_logprobs_unasked",
    "tests/agent/serving/test_fallback.py::test_a_tool_calling_request_is_answered_upstream_with_a_tool_call",
    "tests/agent/serving/test_fallback.py::test_an_unsure_device_answers_when_the_upstream_is_down",
    "tests/agent/serving/test_fallback.py::test_an_unsure_device_is_answered_for_by_the_upstream_and_a_stream_never_mixes",
    "tests/agent/serving/test_fallback.py::test_overloaded_goes_upstream",
    "tests/agent/serving/test_fallback.py::test_policy_off_and_a_quick_device_answer_locally",
    "tests/agent/serving/test_fallback.py::test_the_choices_of_one_answer_come_from_one_model",
    "tests/agent/serving/test_fallback.py::test_the_estimate_sends_a_request_upstream_before_it_starts",
    "tests/attacks/test_canonical_and_config.py::test_fuzz_the_config_loader_never_raises",
    "tests/attacks/test_patch_memory.py::test_a_hostile_bsdiff_patch_is_refused_within_the_memory_bound[huge control values]",  # noqa: E501
    "tests/attacks/test_pull_slow_retrieval.py::test_a_trickling_server_cannot_hold_a_poll_and_the_device_keeps_serving",
    "tests/attacks/test_pull_slow_retrieval.py::test_slow_or_endless_data_is_refused_and_nothing_changes",
    "tests/attacks/test_secrets_never_shown.py::test_no_marker_secret_reaches_any_output",
    "tests/config/test_config_yaml.py::test_alias_bomb_is_refused",
    "tests/docs/test_operating.py",
    "tests/fleet/test_bootstrap.py::test_fresh_device_gets_only_the_agent_and_serves",
    "tests/fleet/test_fleet_adapters.py",
    "tests/fleet/test_fleet_fallback.py",  # its tests build on each other: all or none
    "tests/fleet/test_fleet_local.py",  # likewise
    "tests/fleet/test_threshold_signing.py",
    "tests/fleet/test_wheelhouse.py",
    "tests/hooks/test_hooks.py::test_hanging_hook_is_killed_at_the_timeout_with_its_children",
    "tests/pull/test_pull_promote.py",
    "tests/pull/test_pull_provision.py::test_apply_provisions_pull_mode_then_the_device_polls_by_itself",
    "tests/pull/test_pull_s3.py",
    "tests/push/test_agent_service.py::test_restart_replaces_the_background_agent_and_stop_ends_it",
    "tests/push/test_reimaged.py::test_a_reimaged_device_gets_the_wheelhouse_of_its_new_architecture",
    "tests/push/test_reimaged.py::test_facts_report_the_architecture_the_agent_was_installed_for_and_the_system_torch",
    "tests/push/test_wheelhouse_arch.py::test_a_cross_build_for_a_newer_glibc_than_the_devices_is_refused_naming_both",
    "tests/push/test_wheelhouse_arch.py::test_our_cross_built_wheels_are_found_for_their_architecture_only",
    "tests/quickstart/test_first_hour.py::test_an_ssh_failure_prints_no_traceback",
    "tests/quickstart/test_quickstart.py::test_readme_quickstart_word_for_word_tiny_model",
    "tests/release/test_fuzz.py::test_apply_on_mutated_payload_with_a_valid_checksum",
    "tests/release/test_patch_roundtrip.py::test_apply_memory_stays_below_one_tensor",
)


def _stale(entry: str) -> bool:
    """Whether a LONG entry names a file or test function that is gone (moved or renamed)."""
    file, _, test = entry.partition("::")
    path = Path(__file__).parent.parent / file
    if not path.is_file():
        return True
    function = test.split("[", 1)[0]
    return bool(function) and f"def {function}(" not in path.read_text(encoding="utf-8")


@pytest.hookimpl(tryfirst=True)  # before -m deselects by these markers
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark each test by the costly fixtures it uses (directly or through other fixtures), and the
    LONG ones `long`."""
    if stale := [entry for entry in LONG if _stale(entry)]:
        raise pytest.UsageError(f"tests/conftest.py: LONG names tests that do not exist: {stale}")
    for item in items:
        used = set(getattr(item, "fixturenames", ()))
        for fixture, marker in _MARKER_OF_FIXTURE.items():
            if fixture in used:
                item.add_marker(marker)
        if any(item.nodeid == e or item.nodeid.startswith((f"{e}::", f"{e}[")) for e in LONG):
            item.add_marker("long")
