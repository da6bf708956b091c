"""Generating tokens from a model of a token column (the `gpt` family, or any model of the contract
over one token column), with a key/value cache.

The prompt runs through the model once; then each new token is fed alone, its keys and values
added to the cache, so a step costs one token's work whatever the prompt's length. The context is
the last K tokens (K: the model's window, `data.window`), as in training: a prompt longer than K
keeps its last K tokens, and once the sequence outgrows K each further token is computed from the
last K tokens again (positions are absolute, so cached keys cannot slide), exactly what recomputing
the whole context every step would give, at that cost.

A model without a cache (no `new_cache`) is run on the whole context every step, through its
`forward(cont, cat)`; it must accept windows shorter than K.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn

from shardline.trainer.contract import as_outputs
from shardline.trainer.gpt import check_token_spec
from shardline.trainer.models import data_spec_of


def _check_args(prompt_ids, max_new_tokens: int, temperature: float, top_k: int | None, vocab: int) -> list[int]:
    prompt = [int(t) for t in prompt_ids]
    if not prompt:
        raise ValueError("the prompt is empty: give at least one token id (a separator or end-of-text id will do)")
    bad = [t for t in prompt if not 0 <= t < vocab]
    if bad:
        raise ValueError(f"prompt token id(s) {bad[:5]} are outside the model's vocabulary 0..{vocab - 1}")
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens={max_new_tokens} must be 0 or more")
    if not 0 <= temperature < float("inf"):
        raise ValueError(f"temperature={temperature} must be 0 (greedy) or a finite number above it")
    if top_k is not None and top_k < 1:
        raise ValueError(f"top_k={top_k} must be 1 or more (or unset: every token)")
    return prompt


def next_token(logits: torch.Tensor, temperature: float, top_k: int | None, generator: torch.Generator | None) -> int:
    """One token from the last position's logits [vocab]: the most likely (temperature 0), or drawn from the
    softmax at `temperature` over the `top_k` most likely. Id 0 (padding, or a token never seen in training)
    is never produced."""
    logits = logits.float().clone()
    logits[0] = float("-inf")
    if temperature == 0:
        return int(logits.argmax())
    logits = logits / temperature
    if top_k is not None and top_k < logits.numel():
        kth = torch.topk(logits, top_k).values[-1]
        logits[logits < kth] = float("-inf")
    probs = torch.softmax(logits, dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator))


def generate(model: nn.Module, prompt_ids, max_new_tokens: int, *args, **kwargs) -> list[int]:
    """The token ids that follow `prompt_ids`, all at once: `generate_stream`'s (its arguments)."""
    return list(generate_stream(model, prompt_ids, max_new_tokens, *args, **kwargs))


def _token_spec(model: nn.Module) -> tuple:
    """The model's data spec and its vocabulary's size, or an error saying why it cannot generate."""
    if not hasattr(model, "shardline_spec"):
        raise ValueError(
            f"{type(model).__name__} has no shardline_spec: build it with model_from_spec, or load it with load_model"
        )
    spec = data_spec_of(model.shardline_spec)
    return spec, check_token_spec(spec, family=type(model).__name__)


def _draws(
    model: nn.Module, rows: list[list[int]], temperature: float, top_k: int | None, seed: int | None, use_cache: bool
) -> Iterator[list[int]]:
    """Each step's next token of every row, forever (the caller stops): `rows` are prompts of one length, at most the
    model's window K, generated together (one forward of the batch a step, a key/value cache of the batch), each row
    drawn as it would be alone: its own generator seeded with `seed`, the greedy choice of its own logits. The model
    is the caller's to put in eval mode."""
    spec = data_spec_of(model.shardline_spec)
    target, window = spec.targets[0].name, spec.window
    device = next(model.parameters()).device
    generators: list[torch.Generator | None] = [None] * len(rows)
    if seed is not None:
        generators = [torch.Generator(device=device) for _ in rows]
        for g in generators:
            g.manual_seed(int(seed))
    tokens = torch.tensor(rows, device=device)  # [B, L]: the last K tokens of each row
    cached = use_cache and callable(getattr(model, "new_cache", None))
    with torch.inference_mode():
        cache, filled = (model.new_cache(len(rows)), 0) if cached else (None, 0)
    while True:
        with torch.inference_mode():
            if cached and filled and filled < window:  # the one new token, at the next position
                logits = model.logits(tokens[:, -1:], cache, filled)
                filled += 1
            elif cached:  # the first step, or the context outgrew the cache: the last K tokens from position 0
                logits = model.logits(tokens, cache, 0)
                filled = tokens.shape[1]
            else:
                cont = torch.zeros((*tokens.shape, 0), device=device)
                logits = as_outputs(model(cont, tokens[..., None]), spec)[target]
            last = logits[:, -1]
            if temperature == 0:  # greedy: next_token's choice, for every row at once
                best = last.float().clone()
                best[:, 0] = float("-inf")
                drawn = best.argmax(dim=-1).tolist()
            else:
                drawn = [next_token(last[i], temperature, top_k, g) for i, g in enumerate(generators)]
        tokens = torch.cat([tokens, torch.tensor(drawn, device=device)[:, None]], dim=1)[:, -window:]
        yield drawn


def generate_stream(
    model: nn.Module,
    prompt_ids,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_k: int | None = None,
    seed: int | None = None,
    eos_id: int | None = None,
    use_cache: bool = True,
    stop_ids: tuple[int, ...] = (),
) -> Iterator[int]:
    """The token ids that follow `prompt_ids` (the new ones only, at most `max_new_tokens`), each as soon as it is
    drawn (what `shardline generate` prints as it goes; `generate` gives them all at once); generation stops before
    `eos_id` or any of `stop_ids`, which is not given. `temperature` 0 is greedy; `seed` makes sampling repeatable;
    `top_k` samples among the k most likely tokens only. `use_cache=False` recomputes the whole context for every
    token (the reference the cache must agree with). Each step runs in inference mode; the caller's code between
    tokens does not."""
    spec, vocab = _token_spec(model)
    prompt = _check_args(prompt_ids, max_new_tokens, temperature, top_k, vocab)
    stops = {*stop_ids, *([] if eos_id is None else [eos_id])}
    was_training = model.training
    model.eval()
    try:
        if max_new_tokens:
            for n, (token,) in enumerate(_draws(model, [prompt[-spec.window :]], temperature, top_k, seed, use_cache)):
                if token in stops:
                    break
                yield token
                if n + 1 == max_new_tokens:
                    break
    finally:
        model.train(was_training)


def generate_rows(
    model: nn.Module,
    prompts: list[list[int]],
    max_new_tokens: int,
    temperature: float = 1.0,
    top_k: int | None = None,
    seed: int | None = None,
    eos_id: int | None = None,
    stop_ids: tuple[int, ...] = (),
    batch_size: int = 32,
) -> list[list[int]]:
    """`generate` of each prompt (its arguments), the prompts of one length (after keeping their last K tokens)
    generated `batch_size` at a time: the same tokens as one prompt at a time (each row greedy on its own logits,
    or drawn by its own generator), at a fraction of the time (a step of 32 rows costs a few single rows')."""
    spec, vocab = _token_spec(model)
    rows = [_check_args(p, max_new_tokens, temperature, top_k, vocab)[-spec.window :] for p in prompts]
    stops = {*stop_ids, *([] if eos_id is None else [eos_id])}
    out: list[list[int]] = [[] for _ in rows]
    by_length: dict[int, list[int]] = {}
    for i, r in enumerate(rows):
        by_length.setdefault(len(r), []).append(i)
    was_training = model.training
    model.eval()
    try:
        for same in by_length.values():
            for lo in range(0, len(same) if max_new_tokens else 0, batch_size):
                batch = same[lo : lo + batch_size]
                live = set(range(len(batch)))
                for n, drawn in enumerate(_draws(model, [rows[i] for i in batch], temperature, top_k, seed, True)):
                    for j in sorted(live):
                        if drawn[j] in stops:
                            live.discard(j)
                        else:
                            out[batch[j]].append(drawn[j])
                    if not live or n + 1 == max_new_tokens:
                        break
    finally:
        model.train(was_training)
    return out


def continuations(
    model: nn.Module,
    tokenizer_json: str,
    prompts: list[list[int]],
    max_new_tokens: int,
    temperature: float = 0.0,
    top_k: int | None = None,
    seed: int | None = None,
    stop_at_sep: bool = False,
) -> list[str]:
    """Each prompt's continuation as text (`generate_rows`: prompts of one length together, each drawn as alone),
    decoded with the tokenizer the model was trained with: up to `<eos>`, or, for a generation target
    (`stop_at_sep`), up to the `<sep>` that ends a target in a sequence of several rows. `seed` seeds each prompt's
    draws alike, so a row's continuation does not depend on the rows beside it."""
    from shardline.core.encoding.text import EOS_ID, SEP_ID, decode

    stops = (SEP_ID,) if stop_at_sep else ()  # a target ends at its <sep>: nothing after it is generated
    new = generate_rows(
        model, [ids or [SEP_ID] for ids in prompts], max_new_tokens, temperature, top_k, seed, EOS_ID, stops
    )
    # a text cut by max_new_tokens in a character of several bytes ends in U+FFFD for its bytes so far: left out
    return [cut_whole(decode(tokenizer_json, ids, rows=True), len(ids) >= max_new_tokens) for ids in new]


def cut_whole(text: str, cut: bool) -> str:
    """`text`, without the replacement characters a character's first bytes decode to when the tokens ran out
    (`cut`) inside it."""
    return text.rstrip("\ufffd") if cut else text
