"""The engine factory the server uses: torch by name, a clear refusal for an unknown name."""

import pytest

from deployer.agent.engines import make_engine
from deployer.agent.engines.base import Engine
from deployer.errors import AgentError


def test_torch_engine_by_name():
    assert isinstance(make_engine("torch", context_length=128), Engine)


def test_unknown_engine_lists_the_known_ones():
    with pytest.raises(AgentError, match="unknown engine 'onnx'") as info:
        make_engine("onnx")
    assert "torch" in info.value.hint
