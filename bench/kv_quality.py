"""What a narrower KV cache costs in accuracy: SmolLM2-135M-Instruct (fp32 weights) decoding the
held-out examples/data/eval.txt (every position's keys and values read back from the cache as
stored before attention, as a served sequence reads them) with the KV cache stored in fp16,
bf16 and int8 (agent.kv_cache_type), against the fp32 cache in the same run: mean KL(fp32 || type)
of the next-token distribution, top-1 agreement, perplexity, and the same after a 2,048-token
context (the text repeated) where int8's rounding has more keys to spread over.

    PYTHONPATH=. python bench/kv_quality.py
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from deployer.agent.chat import TextCodec
from deployer.agent.engines.torch.loader import load_model
from deployer.build.demo_model import prepare_smollm2

EVAL = Path(__file__).resolve().parents[1] / "examples" / "data" / "eval.txt"
TYPES = ("fp32", "fp16", "bf16", "int8")


def next_token_logits(model_dir: Path, kv_cache_type: str, tokens: list[int]) -> torch.Tensor:
    """fp32 logits [T - 1, V] of each next token of `tokens`, run as one prompt: its keys and
    values are written to the cache and read back as stored before attention, so each position
    attends what a decode step there would."""
    loaded = load_model(
        model_dir, device="cpu", dtype="fp32", max_context=len(tokens), slots=1, kv_cache_type=kv_cache_type
    )
    with torch.inference_mode():
        logits = loaded.model.prefill(torch.tensor([tokens]), slot=0, start=0, all_logits=True)
    return logits[0, :-1].float()


def compare(
    reference: torch.Tensor, logits: torch.Tensor, targets: torch.Tensor
) -> tuple[float, float, float]:
    """(mean KL(reference || logits), top-1 agreement, perplexity of `targets` under `logits`)."""
    ref, got = reference.log_softmax(-1), logits.log_softmax(-1)
    kl = (ref.exp() * (ref - got)).sum(-1).mean().item()
    top1 = (reference.argmax(-1) == logits.argmax(-1)).float().mean().item()
    nll = -got.gather(-1, targets[:, None]).mean().item()
    return kl, top1, float(torch.tensor(nll).exp())


def main() -> None:
    """Print the table."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--long", type=int, default=2048, help="positions of the long run (0: none)")
    args = parser.parse_args()
    torch.set_num_threads(2)
    model_dir = prepare_smollm2()
    ids = TextCodec.from_dir(model_dir).encode(EVAL.read_text(encoding="utf-8"), add_special_tokens=False)
    runs = {f"eval.txt ({len(ids)} tokens)": ids}
    if args.long:
        runs[f"eval.txt repeated, {args.long} positions"] = (ids * (args.long // len(ids) + 1))[: args.long]
    table = Table(title="SmolLM2-135M-Instruct fp32 weights, KV cache storage against fp32")
    for column in ("text", "kv cache", "mean KL", "top-1", "perplexity"):
        table.add_column(column, justify="left" if column == "text" else "right")
    for name, tokens in runs.items():
        targets = torch.tensor(tokens[1:])
        reference = next_token_logits(model_dir, "fp32", tokens)
        for kv in TYPES:
            logits = reference if kv == "fp32" else next_token_logits(model_dir, kv, tokens)
            kl, top1, ppl = compare(reference, logits, targets)
            table.add_row(name, kv, f"{kl:.2e}", f"{top1:.2%}", f"{ppl:.3f}")
            print(name, kv, kl, top1, ppl, flush=True)
    Console(width=150).print(table)


if __name__ == "__main__":
    main()
