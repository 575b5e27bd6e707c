"""What a reward model with a tokenizer of its own costs on the host: the round trip ``data.retokenize.ChatRebuild``
makes for each rollout batch (responses decoded with the policy's tokenizer, each conversation rendered in the scoring
model's chat template and tokenized again, padded into the scorer's rows), per 1,000 responses.

    python benchmarks/foreign_tokenizer.py [--responses 1000] [--response-tokens 512] [--repeats 5]
    python benchmarks/foreign_tokenizer.py --policy /models/Qwen2.5-7B-Instruct --scorer /models/Skywork-Reward-8B

Without ``--policy`` / ``--scorer`` (no model hub here), two byte-level BPE tokenizers of real vocabulary sizes are
trained offline (``tiny.tokenizer.train_tokenizer``) on Python's standard library sources, each on its own third of
the files: the policy's with 32,768 tokens and ChatML, the scorer's with up to 49,152 (its third holds about 45,000)
and the "User: ..." template. Responses are ``--response-tokens`` policy tokens cut from the docstrings of the last
third (prose the tokenizers did not see), prompts one short user message. The baseline, run in the same process, is
decoding the responses alone: what a rule reward does anyway. Prints the median of ``--repeats`` timed runs after one
untimed one; writes ``benchmarks/results/foreign_tokenizer.json``.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import statistics
import sysconfig
import time
from pathlib import Path

import torch
from transformers import AutoTokenizer

from spmd_rlhf.data.batch import Batch
from spmd_rlhf.data.dataset import encode_prompt
from spmd_rlhf.data.retokenize import ChatRebuild, response_texts
from spmd_rlhf.tiny.tokenizer import train_tokenizer


def standard_library_sources() -> list[str]:
    """The text of every module of the standard library outside its tests, in a fixed order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    paths = sorted(path for path in root.rglob("*.py") if not {"test", "tests", "site-packages"} & set(path.parts))
    return [path.read_text(encoding="utf-8", errors="replace") for path in paths]


def docstrings(sources: list[str]) -> str:
    """The docstrings of ``sources``' modules, classes and functions, one after another."""
    found = []
    for source in sources:
        try:
            tree = ast.parse(source)
        except SyntaxError:
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef)) and ast.get_docstring(node):
                found.append(ast.get_docstring(node))
    return "\n\n".join(found)


def rollout(tokenizer, prose_text: str, *, responses: int, response_tokens: int) -> Batch:
    """``responses`` rows in the policy's tokens: a short chat prompt each, and a window of ``response_tokens``
    tokens of ``prose_text`` (windows overlap when it is short) plus EOS."""
    prose = tokenizer.encode(prose_text, add_special_tokens=False)
    stride = max(1, (len(prose) - response_tokens) // responses)
    raw_prompts = [[{"role": "user", "content": f"Explain module {index % 97}."}] for index in range(responses)]
    prompts = [encode_prompt(tokenizer, raw, where="benchmark") for raw in raw_prompts]
    width = max(map(len, prompts))
    pad = tokenizer.pad_token_id or 0
    prompt_ids = torch.tensor([[pad] * (width - len(ids)) + ids for ids in prompts])
    response_ids = torch.tensor(
        [prose[row * stride : row * stride + response_tokens] + [tokenizer.eos_token_id] for row in range(responses)]
    )
    response_mask = torch.ones_like(response_ids)
    return Batch(
        {
            "prompts": prompt_ids,
            "responses": response_ids,
            "response_mask": response_mask,
            "input_ids": torch.cat([prompt_ids, response_ids], dim=1),
            "attention_mask": torch.cat([(prompt_ids != pad).long(), response_mask], dim=1),
        },
        {"raw_prompt": raw_prompts},
    )


def median_seconds(run, repeats: int) -> float:
    run()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--responses", type=int, default=1000)
    parser.add_argument("--response-tokens", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--policy", help="policy tokenizer directory (default: one trained here, 32,768 tokens)")
    parser.add_argument("--scorer", help="scoring model's tokenizer directory (default: one trained here, 49,152)")
    args = parser.parse_args()
    sources = standard_library_sources()
    if args.policy:
        policy_tokenizer = AutoTokenizer.from_pretrained(args.policy)
    else:
        policy_tokenizer = train_tokenizer(sources[0::3], vocab_size=32768)
    if args.scorer:
        scorer_tokenizer = AutoTokenizer.from_pretrained(args.scorer)
    else:
        scorer_tokenizer = train_tokenizer(sources[1::3], vocab_size=49152, chat_template="role_colon")
    prose = docstrings(sources[2::3])
    batch = rollout(policy_tokenizer, prose, responses=args.responses, response_tokens=args.response_tokens)
    rebuild = ChatRebuild(policy_tokenizer, scorer_tokenizer, role="reward")
    decode_s = median_seconds(
        lambda: response_texts(policy_tokenizer, batch["responses"], batch["response_mask"]), args.repeats
    )
    round_trip_s = median_seconds(lambda: rebuild(batch), args.repeats)
    rebuilt = rebuild(batch)
    responses = (batch["responses"], batch["response_mask"])
    scorer_tokens = int(rebuilt["attention_mask"].sum())
    per_thousand = 1000 / args.responses
    results = {
        "policy": args.policy or "trained here (ChatML)",
        "scorer": args.scorer or "trained here (role_colon template)",
        "policy_vocabulary": len(policy_tokenizer),
        "scorer_vocabulary": len(scorer_tokenizer),
        "responses": args.responses,
        "response_tokens": args.response_tokens,
        "response_characters_per_row": sum(map(len, response_texts(policy_tokenizer, *responses))) / args.responses,
        "scorer_tokens_per_row": scorer_tokens / args.responses,
        "usable_cpus": len(os.sched_getaffinity(0)),
        "load_average": os.getloadavg()[0],
        "decode_only_s_per_1000": decode_s * per_thousand,
        "round_trip_s_per_1000": round_trip_s * per_thousand,
        "round_trip_over_decode": round_trip_s / decode_s,
    }
    print(
        f"{args.responses} responses x {args.response_tokens} policy tokens "
        f"({results['response_characters_per_row']:.0f} characters, {results['scorer_tokens_per_row']:.0f} "
        f"scorer tokens per rebuilt row; vocabularies {results['policy_vocabulary']} -> "
        f"{results['scorer_vocabulary']}), {results['usable_cpus']} usable CPUs, load average "
        f"{results['load_average']:.1f}\n"
        f"  decode only (a rule reward's share)   {results['decode_only_s_per_1000'] * 1000:8.1f} ms per 1,000\n"
        f"  round trip (decode, template, encode) {results['round_trip_s_per_1000'] * 1000:8.1f} ms per 1,000"
        f"   ({results['round_trip_over_decode']:.1f}x decode only)"
    )
    out = Path(__file__).parent / "results" / "foreign_tokenizer.json"
    out.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
