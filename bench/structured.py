"""The cost of constrained decoding: decode time per token with and without a JSON schema (and
with a forced tool call), on the real SmolLM2-135M-Instruct, both engines, batch 1, greedy.

The grammars are the ones the API builds (deployer.agent.openai.constraints), applied by the
engines' shared logit processing (llguidance masks). Each constrained run alternates with a plain
run on the same prompt and each figure is the best of `--repeats` (the machine is shared; a slow
run measures the neighbours), after a warm-up run that also compiles the grammar. The last column
is the time spent in the processing itself (mask, then accepting the token), which the neighbours
disturb less. Target: per-token time with a schema <= 1.3x without.

    PYTHONPATH=. .venv/bin/python bench/structured.py --threads 2
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from deployer.agent.engines import make_engine  # noqa: E402 (after the path)
from deployer.agent.engines.logits import TokenProcessor  # noqa: E402
from deployer.agent.openai.constraints import grammar_for  # noqa: E402
from deployer.agent.openai.schemas import ChatCompletionRequest, parse_request  # noqa: E402
from deployer.agent.types import ChatMessage, SamplingParams  # noqa: E402
from deployer.build.demo_model import prepare_smollm2, smollm2_gguf_path  # noqa: E402
from deployer.build.gguf_writer import GGUF_NAME  # noqa: E402

NEW_TOKENS = 48
QUESTION = "Describe a person who lives in Paris: name, age, city, and whether they are a student."
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "city": {"type": "string", "maxLength": 40},
        "student": {"type": "boolean"},
        "hobbies": {"type": "array", "items": {"type": "string", "maxLength": 20}, "maxItems": 3},
    },
    "required": ["name", "age", "city", "student"],
    "additionalProperties": False,
}
TOOL = {
    "type": "function",
    "function": {
        "name": "register_person",
        "parameters": {k: v for k, v in SCHEMA.items() if k != "additionalProperties"},
    },
}


def grammars() -> dict[str, str | None]:
    """Row label -> the grammar the API would give the engine."""
    base = {"model": "m", "messages": [{"role": "user", "content": QUESTION}]}
    schema = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}}
    named = {"type": "function", "function": {"name": "register_person"}}
    return {
        "json_object": grammar_for(
            parse_request(ChatCompletionRequest, {**base, "response_format": {"type": "json_object"}})
        ),
        "json_schema": grammar_for(parse_request(ChatCompletionRequest, {**base, "response_format": schema})),
        "named tool": grammar_for(
            parse_request(ChatCompletionRequest, {**base, "tools": [TOOL], "tool_choice": named})
        ),
    }


class _Clock:
    """Time spent in the logit processing (mask, bias, penalties), summed over a run."""

    def __init__(self) -> None:
        self.seconds = 0.0
        for name in ("process", "accept"):
            real = getattr(TokenProcessor, name)
            setattr(TokenProcessor, name, self._timed(real))

    def _timed(self, real):
        def timed(processor, *args):
            start = time.perf_counter()
            try:
                return real(processor, *args)
            finally:
                self.seconds += time.perf_counter() - start

        return timed


CLOCK = _Clock()


def run(engine, prompt: list[int], grammar: str | None) -> tuple[float, float, int]:
    """(decode ms per token after the first, processing ms per token, tokens generated)."""
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, grammar=grammar)
    CLOCK.seconds = 0.0
    stamps = [time.perf_counter() for _ in engine.stream(prompt, params)]
    steps = max(1, len(stamps) - 1)
    return (stamps[-1] - stamps[0]) * 1000 / steps, CLOCK.seconds * 1000 / len(stamps), len(stamps)


def engine_for(name: str, threads: int, scratch: Path):
    engine = make_engine(name, context_length=1024, threads=threads)
    if name == "llama.cpp":
        artifact = scratch / "smollm2-gguf"
        artifact.mkdir(exist_ok=True)
        if not (artifact / GGUF_NAME).exists():
            (artifact / GGUF_NAME).symlink_to(smollm2_gguf_path())
    else:
        artifact = prepare_smollm2()
    engine.load(artifact)
    engine.warmup()
    return engine


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--engines", default="llama.cpp,torch")
    args = parser.parse_args()
    rows = grammars()
    print(f"SmolLM2-135M-Instruct, batch 1, greedy, {NEW_TOKENS} new tokens at most, {args.threads} threads")
    print("each constrained run alternates with a plain run on the same prompt; best of", args.repeats)
    head = f"{'engine':<10} {'constraint':<12} {'tokens':>6} {'plain ms/tok':>12} {'ms/tok':>8}"
    print(f"{head} {'x plain':>8} {'mask+proc ms/tok':>16}")
    with tempfile.TemporaryDirectory() as scratch:
        for name in args.engines.split(","):
            engine = engine_for(name, args.threads, Path(scratch))
            messages = [ChatMessage("user", QUESTION)]
            for label, grammar in rows.items():
                if grammar is None:
                    continue
                tools = [TOOL] if label == "named tool" else None
                prompt = engine.chat_prompt(messages, tools=tools)
                run(engine, prompt, grammar)  # warm-up: compiles the grammar, fills caches
                plain, constrained = [], []
                for _ in range(args.repeats):
                    plain.append(run(engine, prompt, None))
                    constrained.append(run(engine, prompt, grammar))
                base = min(r[0] for r in plain)
                ms, proc, tokens = min(constrained)
                cells = f"{tokens:>6} {base:>12.2f} {ms:>8.2f} {ms / base:>7.2f}x {proc:>16.2f}"
                print(f"{name:<10} {label:<12} {cells}")
            engine.unload()


if __name__ == "__main__":
    main()
