"""The model's own chat formatting and tokenizer, without transformers (the device lacks it).

`ChatTemplate` renders messages with the jinja2 template from tokenizer_config.json in the same
sandboxed environment transformers uses (ImmutableSandboxedEnvironment, trim_blocks,
lstrip_blocks, loop controls, `raise_exception`, `strftime_now`, a non-escaping `tojson`), with
the special tokens as variables, so prompts are the same string `apply_chat_template` makes.
`TextCodec` wraps tokenizer.json via the `tokenizers` library. Templates come from model files,
which are untrusted input: the sandbox keeps them from reaching Python internals.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

from deployer.agent.engines.base import ChatMessage
from deployer.errors import AgentError, FormatError

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

    def render(self, messages: Sequence[ChatMessage], add_generation_prompt: bool = True) -> str:
        """The prompt text for `messages`. Raises AgentError when the template refuses them."""
        plain = [{"role": m.role, "content": m.content} for m in messages]
        try:
            return self._template.render(
                messages=plain,
                tools=None,
                documents=None,
                add_generation_prompt=add_generation_prompt,
                **self._variables,
            )
        except jinja2.exceptions.TemplateError as exc:
            raise AgentError(f"{self._where}: the chat template rejected the messages: {exc}") from exc


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

    def eos_ids(self, tokenizer_config: dict[str, Any]) -> set[int]:
        """The id of tokenizer_config's eos_token, as a set (empty when it has none)."""
        text = _token_text(tokenizer_config.get("eos_token"))
        token = None if text is None else self.token_id(text)
        return set() if token is None else {token}
