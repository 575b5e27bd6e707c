"""A one-command smoke run of the model stack: load a Hugging Face directory, chat-template a prompt, decode greedily.

    spmd-rlhf forward --model tiny/model --prompt "3+4="

Decoding recomputes the whole sequence each step (no KV cache and no engine): it checks the loading path and the
model code end to end on any directory, with nothing else of the framework involved. Generation for training runs in
the engine (``spmd_rlhf.engine``).
"""

from __future__ import annotations

import torch

from spmd_rlhf.models.weights import load_model


def greedy_continue(
    model: torch.nn.Module, input_ids: torch.Tensor, *, max_new_tokens: int, eos_token_id: int | None
) -> list[int]:
    """Greedy tokens after ``input_ids`` ``[1, seq]`` until eos or ``max_new_tokens``."""
    new_tokens: list[int] = []
    with torch.no_grad():
        for _ in range(max_new_tokens):
            next_token = int(model(input_ids)[0, -1].argmax())
            new_tokens.append(next_token)
            if next_token == eos_token_id:
                break
            input_ids = torch.cat([input_ids, torch.tensor([[next_token]])], dim=1)
    return new_tokens


def run_forward(model_dir: str, *, prompt: str, dtype: str = "float32", max_new_tokens: int = 8) -> list[int]:
    """Print the templated prompt, its token count, the next-token distribution's top entries and a greedy reply."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = load_model(model_dir, dtype=dtype).eval()
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
    )
    input_ids = torch.tensor([tokenizer.encode(text)])
    with torch.no_grad():
        next_token_probs = model(input_ids)[0, -1].float().softmax(-1)
    top = next_token_probs.topk(3)
    print(f"model: {model.args.family}, {sum(p.numel() for p in model.parameters()):,} parameters, {dtype}")
    print(f"prompt: {text!r} ({input_ids.shape[1]} tokens)")
    print(
        "next token: "
        + ", ".join(f"{tokenizer.decode([int(i)])!r} {float(p):.3f}" for p, i in zip(top.values, top.indices))
    )
    reply = greedy_continue(model, input_ids, max_new_tokens=max_new_tokens, eos_token_id=tokenizer.eos_token_id)
    print(f"greedy reply: {tokenizer.decode(reply)!r}")
    return reply
