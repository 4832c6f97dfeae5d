"""The model's own chat formatting and tokenizer, without transformers (the device lacks it).

`ChatTemplate` renders messages with the jinja2 template from tokenizer_config.json in the same
sandboxed environment transformers uses (ImmutableSandboxedEnvironment, trim_blocks,
lstrip_blocks, loop controls, `raise_exception`, `strftime_now`, a non-escaping `tojson`), with
the special tokens as variables, so prompts are the same string `apply_chat_template` makes.
`TextCodec` wraps tokenizer.json via the `tokenizers` library. Templates come from model files,
which are untrusted input: the sandbox keeps them from reaching Python internals.

Tools: the template receives the OpenAI `tools`, assistant messages with `tool_calls` (arguments
as objects, as HF templates expect) and `tool` messages, where it renders them; what it does
not render (probed once per template) is written into the conversation as text in the Hermes
format (`<tool_call>{"name": ..., "arguments": ...}</tool_call>`, the tools in the system
message), the format the agent's tool-call grammar and parser use for every model.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

from deployer.agent.types import ChatMessage, ToolCall
from deployer.errors import AgentError, FormatError

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"
# Fill-in-the-middle tokens (prefix, suffix, middle) of the model families that have them.
FIM_TOKENS = (
    ("<fim_prefix>", "<fim_suffix>", "<fim_middle>"),  # StarCoder, SmolLM
    ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"),  # Qwen2.5-Coder, DeepSeek
)
_PROBE_NAME = "sits_probe_function"
_PROBE_RESULT = "sits_probe_result"
_PROBE_TOOL = {
    "type": "function",
    "function": {"name": _PROBE_NAME, "description": "", "parameters": {"type": "object"}},
}
_PROBE_CALL = ToolCall(id="call_probe", name=_PROBE_NAME, arguments="{}")


def tool_call_frame(name: str) -> tuple[str, str]:
    """The text around a call's arguments: `<tool_call>\n{"name": NAME, "arguments": ` before,
    `}\n</tool_call>` after."""
    return f'{TOOL_CALL_OPEN}\n{{"name": {json.dumps(name)}, "arguments": ', f"}}\n{TOOL_CALL_CLOSE}"


def tool_call_text(call: ToolCall) -> str:
    """A call as the model writes it."""
    before, after = tool_call_frame(call.name)
    return before + (call.arguments.strip() or "{}") + after


def tools_prompt(tools: Sequence[dict]) -> str:
    """The tools and the call format, for templates that do not render tools themselves (the
    Hermes format's wording, shortened: small models have small contexts)."""
    listed = "\n".join(json.dumps(tool, ensure_ascii=False, separators=(",", ":")) for tool in tools)
    before, after = tool_call_frame("<function-name>")
    example = before.replace('"<function-name>"', "<function-name>") + "<args-json-object>" + after
    return (
        f"You may call functions. Their signatures:\n<tools>\n{listed}\n</tools>\n"
        f"To call one, answer with:\n{example}"
    )


SPECIAL_TOKEN_KEYS = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)


def _token_text(value: object) -> str | None:
    # tokenizer_config.json writes special tokens as strings or as AddedToken dicts.
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def special_tokens(tokenizer_config: dict[str, Any]) -> dict[str, Any]:
    """The special-token variables a chat template sees (bos_token, eos_token, ...)."""
    found: dict[str, Any] = {}
    for key in SPECIAL_TOKEN_KEYS:
        text = _token_text(tokenizer_config.get(key))
        if text is not None:
            found[key] = text
    extra = tokenizer_config.get("additional_special_tokens") or []
    extra_texts = [t for t in (_token_text(v) for v in extra) if t is not None]
    if extra_texts:
        found["additional_special_tokens"] = extra_texts
    return found


def _select_template(value: object, where: Path) -> str | None:
    if value is None:
        return None
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        if isinstance(named.get("default"), str):
            return named["default"]
    raise FormatError(
        f"{where}: chat_template must be a string or a list with a 'default' entry",
        hint="fix tokenizer_config.json of the model and rebuild the artifact",
    )


class GenerationTag(jinja2.ext.Extension):
    """Accept `{% generation %}...{% endgeneration %}` (HF's assistant-mask tag) as a no-op."""

    # jinja2 annotates tags as set[str], but only iterates it; a frozenset keeps the class immutable.
    tags = frozenset({"generation"})  # type: ignore[assignment]

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        """Parse the block body and render it unchanged."""
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller: Any) -> str:
        return caller()


class ChatTemplate:
    """A compiled chat template plus the special tokens it may refer to."""

    def __init__(self, source: str, variables: dict[str, Any], where: Path) -> None:
        def raise_exception(message: str) -> None:
            raise jinja2.exceptions.TemplateError(message)

        def tojson(
            x: Any,
            ensure_ascii: bool = False,
            indent: int | None = None,
            separators: Any = None,
            sort_keys: bool = False,
        ) -> str:
            return json.dumps(
                x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
            )

        env = ImmutableSandboxedEnvironment(
            trim_blocks=True,
            lstrip_blocks=True,
            extensions=[GenerationTag, jinja2.ext.loopcontrols],
        )
        env.filters["tojson"] = tojson
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        self._where = where
        self._variables = dict(variables)
        try:
            self._template = env.from_string(source)
        except jinja2.exceptions.TemplateError as exc:
            raise AgentError(f"{where}: the chat template does not compile: {exc}") from exc

    @classmethod
    def from_dir(cls, directory: Path) -> ChatTemplate | None:
        """The template of a model directory (tokenizer_config.json, or chat_template.jinja);
        None when the model has none (a base model)."""
        config_path = directory / "tokenizer_config.json"
        config = read_tokenizer_config(directory)
        source = config.get("chat_template")
        jinja_file = directory / "chat_template.jinja"
        if source is None and jinja_file.is_file():
            source = jinja_file.read_text(encoding="utf-8")
        selected = _select_template(source, config_path)
        return None if selected is None else cls(selected, special_tokens(config), config_path)

    def render(
        self,
        messages: Sequence[ChatMessage],
        add_generation_prompt: bool = True,
        tools: Sequence[dict] | None = None,
    ) -> str:
        """The prompt text for `messages` and the `tools` the model may call. Raises AgentError when
        the template refuses them."""
        caps = self.capabilities
        messages = list(messages)
        if tools and not caps.tools:
            messages = _with_system_text(messages, tools_prompt(tools))
        plain = [_template_message(m, caps) for m in messages]
        try:
            return self._render(plain, list(tools) if tools and caps.tools else None, add_generation_prompt)
        except (jinja2.exceptions.TemplateError, TypeError, ValueError) as exc:
            # TypeError: a template doing arithmetic on what it did not expect (None content, say).
            raise AgentError(f"{self._where}: the chat template rejected the messages: {exc}") from exc

    def _render(self, messages: list[dict], tools: list[dict] | None, add_generation_prompt: bool) -> str:
        return self._template.render(
            messages=messages,
            tools=tools,
            documents=None,
            add_generation_prompt=add_generation_prompt,
            **self._variables,
        )

    @functools.cached_property
    def capabilities(self) -> TemplateCapabilities:
        """What of the tool conversation this template renders itself (probed by rendering)."""
        user = {"role": "user", "content": "x"}
        tools = _PROBE_NAME in self._probe([user], [_PROBE_TOOL])
        call = ChatMessage("assistant", "", tool_calls=(_PROBE_CALL,))
        native = _template_message(call, TemplateCapabilities(tool_calls=True))
        tool_calls = _PROBE_NAME in self._probe([user, native], None)
        caps = TemplateCapabilities(tools=tools, tool_calls=tool_calls)
        answer = {"role": "tool", "content": _PROBE_RESULT, "tool_call_id": _PROBE_CALL.id}
        rendered = self._probe([user, _template_message(call, caps), answer], None)
        return dataclasses.replace(caps, tool_role=_PROBE_RESULT in rendered)

    def _probe(self, messages: list[dict], tools: list[dict] | None) -> str:
        try:
            return self._render(messages, tools, add_generation_prompt=True)
        except Exception:  # any refusal means "not supported"; the template is the model's, not ours
            return ""


@dataclass(frozen=True)
class TemplateCapabilities:
    """Which parts of a tool conversation a chat template renders itself."""

    tools: bool = False  # the `tools` variable
    tool_calls: bool = False  # assistant messages' `tool_calls`
    tool_role: bool = False  # messages of role "tool"


def _template_message(message: ChatMessage, caps: TemplateCapabilities) -> dict:
    """A message as the template gets it; what it cannot render becomes text in the Hermes format."""
    if message.role == "tool" and not caps.tool_role:
        return {"role": "user", "content": f"<tool_response>\n{message.content}\n</tool_response>"}
    out: dict[str, Any] = {"role": message.role, "content": message.content}
    if message.role == "tool":
        out["tool_call_id"] = message.tool_call_id
    if message.tool_calls and caps.tool_calls:
        out["tool_calls"] = [
            {
                "id": call.id,
                "type": "function",
                "function": {"name": call.name, "arguments": _arguments(call.arguments)},
            }
            for call in message.tool_calls
        ]
    elif message.tool_calls:
        calls = "\n".join(tool_call_text(call) for call in message.tool_calls)
        out["content"] = f"{message.content}\n{calls}" if message.content else calls
    return out


def _arguments(text: str) -> Any:
    """A call's JSON arguments as an object (HF templates write them with `tojson`)."""
    try:
        return json.loads(text) if text.strip() else {}
    except json.JSONDecodeError:
        return text


def _with_system_text(messages: list[ChatMessage], text: str) -> list[ChatMessage]:
    """`text` appended to the system message (a system message with it first when there is none)."""
    if messages and messages[0].role == "system":
        first = messages[0]
        return [dataclasses.replace(first, content=f"{first.content}\n\n{text}"), *messages[1:]]
    return [ChatMessage("system", text), *messages]


def read_tokenizer_config(directory: Path) -> dict[str, Any]:
    """tokenizer_config.json as a dict ({} when the file is absent)."""
    path = directory / "tokenizer_config.json"
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise FormatError(f"{path}: not readable JSON ({exc})") from exc
    if not isinstance(data, dict):
        raise FormatError(f"{path}: expected a JSON object")
    return data


@dataclass(frozen=True)
class TextCodec:
    """tokenizer.json through the `tokenizers` library: text <-> ids."""

    tokenizer: Tokenizer

    @classmethod
    def from_dir(cls, directory: Path) -> TextCodec:
        """Load `<directory>/tokenizer.json`."""
        path = directory / "tokenizer.json"
        try:
            return cls(Tokenizer.from_file(str(path)))
        except Exception as exc:  # the Rust side raises plain Exception for any bad file
            raise FormatError(f"{path}: cannot load the tokenizer ({exc})") from exc

    def encode(self, text: str, *, add_special_tokens: bool) -> list[int]:
        """Token ids of `text`; chat prompts pass add_special_tokens=False, as transformers does."""
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int]) -> str:
        """Text of `ids`, special tokens left out."""
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def token_id(self, text: str) -> int | None:
        """The id of a single token's text, if the vocabulary has it."""
        return self.tokenizer.token_to_id(text)

    def to_json(self) -> str:
        """tokenizer.json's text (what llguidance reads the vocabulary from)."""
        return self.tokenizer.to_str()

    def eos_ids(self, tokenizer_config: dict[str, Any]) -> set[int]:
        """The id of tokenizer_config's eos_token, as a set (empty when it has none)."""
        text = _token_text(tokenizer_config.get("eos_token"))
        token = None if text is None else self.token_id(text)
        return set() if token is None else {token}


def infill_prompt(
    token_id: Callable[[str], int | None], encode: Callable[[str], list[int]], prefix: str, suffix: str
) -> list[int]:
    """The prefix-suffix-middle prompt for filling in between `prefix` and `suffix`, with the first
    set of FIM_TOKENS that the vocabulary has (`token_id`: a special token's id or None; `encode`:
    plain text to ids). AgentError when it has none."""
    for names in FIM_TOKENS:
        pre, suf, mid = (token_id(name) for name in names)
        if pre is not None and suf is not None and mid is not None:
            return [pre, *encode(prefix), suf, *encode(suffix), mid]
    raise AgentError(
        "this model has no fill-in-the-middle tokens, so `suffix` cannot be honoured",
        hint="send the prompt without `suffix`",
    )
