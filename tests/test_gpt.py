"""The built-in `gpt` family (shardline/trainer/gpt.py), its generation with a key/value cache
(shardline/trainer/generate.py) and the text metrics (shardline/core/metrics/text.py): tiny models,
seconds each; one real training over shards the encode step wrote from a column of token ids."""

from __future__ import annotations

import math

import numpy as np
import polars as pl
import pytest
import torch

from shardline.core.config import ConfigError, ModelConfig, TrainingConfig, validate_config
from shardline.core.metrics.text import perplexity, text_generation_scores, token_f1, unigram_perplexity
from shardline.trainer.contract import DataSpec, ModelContractError, TargetInfo
from shardline.trainer.generate import generate
from shardline.trainer.models import model_from_spec, model_spec_for
from tests.conftest import tiny_config

V, K = 50, 16
TINY = {"family": "gpt", "hidden": 32, "layers": 2, "heads": 4, "dropout": 0.0}


def token_spec(vocab: int = V, window: int = K, **target) -> DataSpec:
    t = {"name": "tokens", "kind": "classification", "n_classes": vocab, "positions": "all", **target}
    return DataSpec([], [], ["tokens"], [vocab], window, [TargetInfo(**t)])


def tiny_gpt(spec: DataSpec | None = None, **model) -> torch.nn.Module:
    return model_from_spec(model_spec_for(ModelConfig(**{**TINY, **model}), spec or token_spec()))


@pytest.fixture(scope="module")
def varied():
    """A tiny GPT with large random weights (float64): its greedy choices differ from token to token, so two
    ways of generating that disagree anywhere produce different sequences."""
    torch.manual_seed(0)
    model = tiny_gpt().double().eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.4)
    return model


def test_contract_shapes_causality_and_tied_weights():
    model = tiny_gpt().eval()
    cat = torch.randint(1, V, (3, K, 1))
    out = model(torch.zeros(3, K, 0), cat)
    assert list(out) == ["tokens"] and tuple(out["tokens"].shape) == (3, K, V)
    later = cat.clone()
    later[:, 10] = (later[:, 10] % (V - 1)) + 1  # another token at position 10
    again = model(torch.zeros(3, K, 0), later)["tokens"]
    assert torch.allclose(out["tokens"][:, :10], again[:, :10], atol=1e-6)  # no earlier position sees it
    assert not torch.allclose(out["tokens"][:, 10:], again[:, 10:])
    assert model.lm_head.weight is model.wte.weight  # one tensor: the output layer is the embedding
    with torch.no_grad():
        model.wte.weight[7] += 1.0
    assert not torch.equal(model(torch.zeros(3, K, 0), cat)["tokens"], out["tokens"])
    names = [n for n, _ in model.named_parameters()]
    assert "lm_head.weight" not in names  # tied: counted and trained once
    assert model.state_dict()["lm_head.weight"].data_ptr() == model.state_dict()["wte.weight"].data_ptr()
    # init_from a gpt of another context: its learned positions are refused, not silently re-initialised
    from shardline.trainer.contract import load_matching

    with pytest.raises(ModelContractError, match=r"\(wpe.weight\) cover a context of 32 positions, this model's 16"):
        load_matching(model, tiny_gpt(token_spec(window=32)).state_dict(), "models:/lm/1")


def test_what_it_refuses_names_what_it_needs():
    two_columns = DataSpec([], [], ["tokens", "other"], [V, 5], K, [TargetInfo("tokens", "classification", V, "all")])
    with pytest.raises(ModelContractError, match=r"exactly one token column.*\['tokens', 'other'\]"):
        tiny_gpt(two_columns)
    with pytest.raises(ModelContractError, match="target_positions: all"):
        tiny_gpt(token_spec(positions="last"))
    with pytest.raises(ModelContractError, match="12 classes, 'tokens' has 50 ids"):
        tiny_gpt(token_spec(n_classes=12))
    with pytest.raises(ModelContractError, match="regression"):
        tiny_gpt(token_spec(kind="regression", n_classes=None))
    for model, key in (
        ({"hidden": 30}, r"model.hidden=30 must be divisible by model.heads=4"),
        ({"params": {"d_model": 30}}, r"model.params.d_model=30 must be divisible by model.heads=4"),
        ({"params": {"n_head": 0}}, r"model.params.n_head=0 must be a whole number >= 1"),
        ({"params": {"block": 3}}, r"model.params \['block'\] are not gpt settings"),
        ({"params": {"bias": "yes"}}, r"model.params.bias='yes' must be true or false"),
    ):
        with pytest.raises(ValueError, match=key):
            ModelConfig(**{**TINY, **model})
    raw = tiny_config("/x", "/y", model={"family": "gpt"})  # continuous, boolean and categorical features
    with pytest.raises(ConfigError, match=r"exactly one token column .* lists \['x', 'y', 'flag', 'kind'\]"):
        validate_config(raw)
    raw["data"]["features"] = {"categorical": ["kind"]}
    with pytest.raises(ConfigError, match="gpt predicts the next token at every position"):
        validate_config(raw)
    # two text columns are one token stream (joined with <sep>): the gpt reads it (it refused them)
    text = {**raw["data"], "features": {"text": ["title", "body"]}, "tokenizer": {"kind": "bpe", "vocab_size": 300}}
    text.update(sequence_key=None, order_by=None, target=None, split={"method": "hash"}, window=8)
    assert validate_config({**raw, "data": text}).data.features.text == ["title", "body"]
    with pytest.raises(ConfigError, match=r"text data \(data.features.text\) predicts the next token at every"):
        validate_config({**raw, "data": text, "model": {"family": "mlp"}})  # it named target_positions, unwritten

    # generation settings of a registered text model (its predict params, `shardline generate`'s options)
    from shardline.core.encoding.columns import DataError
    from shardline.trainer.serving_text import generation_params

    assert generation_params({"max_tokens": 4.0, "temperature": 0.5}) == {
        "max_tokens": 4,
        "temperature": 0.5,
        "top_k": 0,
        "seed": 0,
    }
    for params, said in (
        ({"max_tokens": 2.7}, r"max_tokens=2.7 must be a whole number"),
        ({"top_k": True}, r"top_k=True must be a whole number"),
        ({"temperature": float("inf")}, r"temperature=inf must be 0 \(greedy\) or a finite number"),
        ({"temperature": -1}, r"temperature=-1.0 must be 0 \(greedy\) or a finite number"),
        ({"beams": 4}, r"unknown generation param\(s\) \['beams'\]"),
        ({"seed": 1 << 64}, r"seed=18446744073709551616 must be a whole number below 2\*\*64"),  # torch's overflow
    ):
        with pytest.raises(DataError, match=said):
            generation_params(params)
    with pytest.raises(ValueError, match="temperature=inf must be 0"):
        generate(tiny_gpt(), [1, 2], 3, temperature=float("inf"))
    # model.params under nanoGPT's names win over model.hidden/layers/heads
    model = tiny_gpt(params={"d_model": 16, "n_layer": 1, "n_head": 2, "bias": True})
    assert (model.d_model, model.n_layer, model.n_head) == (16, 1, 2) and model.ln_f.bias is not None


def test_generation_with_the_cache_is_generation_by_recomputation(varied):
    seen = set()
    for prompt, new in (([5], 12), ([3, 4, 5, 6, 7, 8], 8), (list(range(1, 30)), 6), ([9, 10], 40)):
        cached = generate(varied, prompt, new, temperature=0)
        assert cached == generate(varied, prompt, new, temperature=0, use_cache=False), prompt
        assert len(cached) == new
        seen.update(cached)
    assert len(seen) > 5  # varied tokens: the comparison means something
    # a prompt longer than the context keeps its last K tokens
    long = list(range(1, 40))
    assert generate(varied, long, 5, temperature=0) == generate(varied, long[-K:], 5, temperature=0)


def test_the_cache_feeds_one_token_per_step(varied):
    fed = []
    hook = varied.wte.register_forward_hook(lambda m, args, out: fed.append(args[0].numel()))
    try:
        counts = {}
        for n in (4, 12):
            for cache in (True, False):
                fed.clear()
                generate(varied, list(range(1, n + 1)), 4, temperature=0, use_cache=cache)
                counts[n, cache] = list(fed)
    finally:
        hook.remove()
    assert counts[4, True] == [4, 1, 1, 1] and counts[12, True] == [12, 1, 1, 1]  # the prompt once, then 1 a step
    assert counts[12, False] == [12, 13, 14, 15]  # recomputing: every step costs the whole context


def test_sampling_with_a_seed_repeats_and_top_k_is_respected(varied):
    a = generate(varied, [1, 2, 3], 30, temperature=1.5, seed=7)
    assert a == generate(varied, [1, 2, 3], 30, temperature=1.5, seed=7)
    assert a != generate(varied, [1, 2, 3], 30, temperature=1.5, seed=8)
    assert generate(varied, [1, 2, 3], 30, top_k=1, seed=3) == generate(varied, [1, 2, 3], 30, temperature=0)
    allowed = set()
    for seed in range(40):  # the first token after the prompt, drawn among the 3 most likely only
        allowed.add(generate(varied, [4, 5], 1, temperature=5.0, top_k=3, seed=seed)[0])
    logits = varied.logits(torch.tensor([[4, 5]]))[0, -1].clone()
    logits[0] = float("-inf")
    assert allowed <= set(torch.topk(logits, 3).indices.tolist()) and len(allowed) > 1
    full = generate(varied, [1, 2, 3], 30, temperature=0)
    stop = full.index(full[3])  # generation stops before the end-of-text id, which is not returned
    assert generate(varied, [1, 2, 3], 30, temperature=0, eos_id=full[3]) == full[:stop] != full
    # a generation target's <sep> stops it too, drawn or not: what came before it is the same
    assert generate(varied, [1, 2, 3], 30, temperature=0, stop_ids=(full[3], 49)) == full[:stop]
    drawn = generate(varied, [1, 2, 3], 30, temperature=1.5, seed=7)
    assert (
        generate(varied, [1, 2, 3], 30, temperature=1.5, seed=7, stop_ids=(drawn[5],)) == drawn[: drawn.index(drawn[5])]
    )
    with pytest.raises(ValueError, match=r"prompt token id\(s\) \[50\] are outside the model's vocabulary 0..49"):
        generate(varied, [1, 50], 3)
    with pytest.raises(ValueError, match="prompt is empty"):
        generate(varied, [], 3)


def test_prompts_generated_together_give_what_each_gives_alone(varied):
    """`generate_rows` (what predict and the evaluation call) runs the prompts of one length together, a batch a step:
    each row's tokens are those it gets alone, greedy or drawn with a seed, stopped at its own end-of-text, in
    batches of a few; far fewer forward passes than one prompt at a time."""
    from shardline.trainer.generate import generate_rows

    prompts = [[5], [3, 4, 5], [7, 8, 9], [9, 1, 2], list(range(1, 30)), list(range(2, 18)), [11, 12, 13, 14, 15, 16]]
    calls = []
    hook = varied.wte.register_forward_hook(lambda m, args, out: calls.append(args[0].shape[0]))
    try:
        for kwargs in (
            {"temperature": 0},
            {"temperature": 1.5, "seed": 7},
            {"temperature": 2.0, "top_k": 5, "seed": 1},
        ):
            alone = [generate(varied, p, 20, **kwargs) for p in prompts]
            calls.clear()
            assert generate_rows(varied, prompts, 20, batch_size=2, **kwargs) == alone, kwargs
            assert max(calls) == 2 and len(calls) <= 5 * 20  # 5 batches (lengths 1, 3 [x3], 16 [x2], 6), 20 steps each
            assert len({t for a in alone for t in a}) > 5
        stop = alone[1][4]  # an end-of-text id: each row stops before its own first one
        cut = [a[: a.index(stop)] if stop in a else a for a in alone]
        assert generate_rows(varied, prompts, 20, eos_id=stop, batch_size=3, **kwargs) == cut != alone
        assert generate_rows(varied, prompts, 0) == [[]] * len(prompts)
    finally:
        hook.remove()
    with pytest.raises(ValueError, match=r"prompt token id\(s\) \[50\]"):
        generate_rows(varied, [[1], [1, 50]], 3)


def test_text_metrics_by_hand():
    assert perplexity(0.0) == 1.0 and math.isclose(perplexity(math.log(7)), 7.0)
    assert perplexity(1e6) == math.inf
    with pytest.raises(ValueError, match=">= 0"):
        perplexity(float("nan"))
    # unigram: train counts 1:3, 2:1 -> add-one p = 4/6, 2/6; eval one of each: exp(-(ln 4/6 + ln 2/6)/2)
    assert math.isclose(unigram_perplexity([9, 3, 1], [5, 1, 1]), math.exp(-(math.log(4 / 6) + math.log(2 / 6)) / 2))
    # "the cat sat" vs "The cat sat down": 3 shared, P 3/3, R 3/4 -> F1 6/7; "a a b" vs "a b b": 2 shared -> 2/3
    assert math.isclose(token_f1("the cat sat", "The cat sat down"), 6 / 7)
    assert math.isclose(token_f1("a a b", "a b b"), 2 / 3)
    assert token_f1("", "") == 1.0 and token_f1("x", "") == 0.0 and token_f1("x y", "z") == 0.0
    scores = text_generation_scores(["The  Cat", "a a b", "no"], ["the cat", "a b b", "yes"])
    assert math.isclose(scores["exact_match"], 1 / 3)
    assert math.isclose(scores["token_f1"], (1.0 + 2 / 3 + 0.0) / 3)
    with pytest.raises(ValueError, match="2 predictions for 1 references"):
        text_generation_scores(["a", "b"], ["a"])


def token_corpus(folder, sequences: int = 24, length: int = 120, vocab: int = 20) -> None:
    """Sequences of token ids following a fixed rule (the next token is (3 * token + 1) mod vocab, from a random
    start, with one random token in ten): a small GPT learns it from the previous token."""
    rng = np.random.default_rng(0)
    rows = []
    for s in range(sequences):
        tok = int(rng.integers(vocab))
        for t in range(length):
            rows.append((f"s{s:03d}", t, tok + 100))  # ids 100..: the encode gives them their own vocabulary
            tok = int(rng.integers(vocab)) if rng.random() < 0.1 else (3 * tok + 1) % vocab
    folder.mkdir()
    frame = pl.DataFrame(rows, schema=["seq", "t", "tokens"], orient="row")
    for i in range(2):
        frame.filter(pl.col("seq").is_in([f"s{s:03d}" for s in range(i, sequences, 2)])).write_parquet(
            folder / f"part-{i}.parquet"
        )


def test_a_small_gpt_trains_on_encoded_token_shards_and_generates(tmp_path):
    from shardline.core.manifest import Manifest
    from shardline.tasks.encode import encode_dataset
    from shardline.tasks.ingest import snapshot_source
    from shardline.trainer.data import open_split
    from shardline.trainer.inference import load_model
    from shardline.trainer.loop import Callbacks, fit
    from shardline.trainer.serving import data_spec

    token_corpus(tmp_path / "raw")
    raw = tiny_config(str(tmp_path / "raw"), str(tmp_path / "store"))
    raw["data"].update(
        window=K,
        horizon=1,
        target_positions="all",
        features={"categorical": ["tokens"]},
        target={"column": "tokens", "task": "classification"},
    )
    raw["model"] = dict(TINY)
    raw["training"].update(epochs=2, batch_size=32, lr=3e-3, warmup_steps=5, max_steps_per_epoch=40)
    cfg = validate_config(raw)
    uri = encode_dataset(snapshot_source(cfg.data), cfg.data, str(tmp_path / "data"), threads=1)
    manifest = Manifest.model_validate_json((tmp_path / "data" / "manifest.json").read_text())
    spec = model_spec_for(cfg.model, data_spec(manifest.encoding))
    assert spec["data"]["cardinalities"] == [21] and spec["data"]["targets"][0]["n_classes"] == 21
    train, val = open_split(manifest, uri, "train"), open_split(manifest, uri, "validation")
    result = fit(
        train,
        val,
        spec,
        TrainingConfig(**raw["training"]),
        "classification",
        str(tmp_path / "ck"),
        callbacks=Callbacks(log=print),
    )
    first, last = result.history[0], result.history[-1]  # log(21) = 3.04: a uniform guess over the 21 ids
    assert first["train_loss"] < math.log(21) and last["val_loss"] < 0.6 * math.log(21), result.history
    assert last["val_accuracy"] > 0.6
    # the trained model continues the rule it learned: ids map back to the raw tokens through the vocabulary
    model = load_model(result.best_checkpoint)
    vocab = manifest.encoding.categorical[0].values
    ids = {int(v): i + 1 for i, v in enumerate(vocab)}
    prompt = [100 + t for t in (3, 10, 11)]
    out = [int(vocab[i - 1]) - 100 for i in generate(model, [ids[p] for p in prompt], 6, temperature=0)]
    expect, tok = [], 11
    for _ in range(6):
        tok = (3 * tok + 1) % 20
        expect.append(tok)
    assert sum(a == b for a, b in zip(out, expect)) >= 4, (out, expect)


class Bigram(torch.nn.Module):
    """Next-token logits from the current token alone: a token's loss is the same in whichever window it is
    scored, so the mean over each token once can be computed by hand from the whole stream."""

    def __init__(self, vocab: int):
        super().__init__()
        self.table = torch.nn.Embedding(vocab, vocab)

    def forward(self, cont, cat):
        return {"tokens": self.table(cat[..., 0].long())}


def test_text_evaluation_scores_each_token_once():
    from shardline.trainer.data import ScoredLoader, SplitData, WindowLoader
    from shardline.trainer.validate import evaluate

    rng = np.random.default_rng(0)
    lengths = [K * 3 + 5, K + 1, 2 * K + 1, K * 4]  # a tail, exactly one window, two windows, a tail again
    tokens = np.concatenate([rng.integers(1, V, n) for n in lengths]).astype(np.uint16)
    tokens[np.cumsum(lengths)[1] - 3 :][:2] = 0  # two <pad> targets (as a short stream's padding)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    arrays = {"cont": np.zeros((len(tokens), 0), np.float32), "cat": tokens[:, None], "target": tokens}
    arrays["offsets"] = offsets
    data = SplitData([arrays], K, 1, positions="all")
    spec = DataSpec([], [], ["tokens"], [V], K, [TargetInfo("tokens", "classification", V, "all")], text={"pad_id": 0})
    torch.manual_seed(0)
    model = Bigram(V)
    # by hand: every (token, next token) pair of each stream once, <pad> targets left out
    losses = []
    with torch.no_grad():
        for lo, hi in zip(offsets[:-1], offsets[1:]):
            x, y = (
                torch.from_numpy(tokens[lo : hi - 1].astype(np.int64)),
                torch.from_numpy(tokens[lo + 1 : hi].astype(np.int64)),
            )
            ce = torch.nn.functional.cross_entropy(model.table(x), y, reduction="none")
            losses.append(ce[y != 0])
    by_hand = torch.cat(losses).double().mean().item()
    got = evaluate(model, data, 7, torch.device("cpu"), spec=spec)
    assert got["val_perplexity"] == pytest.approx(math.exp(by_hand), rel=1e-6)
    # each real target once: as many as the streams hold, in about 1/K of the windows
    scored = ScoredLoader(data, 7, stride=True)
    assert sum(int((b.targets[0] != 0).sum()) for b in scored) == sum(len(x) for x in losses)
    assert scored.n_windows == 4 + 1 + 2 + 4 < data.n_windows // 4
    every = [b.targets[0] for b in WindowLoader(data, 7, seed=0, shuffle=False)]
    assert sum(int((t != 0).sum()) for t in every) > 5 * int((tokens != 0).sum())  # what it cost before


def test_generation_test_pairs_are_each_sequences_source_and_target():
    """The prompts evaluation generates from are the sources with their <sep>, the references the targets'
    tokens without the <eos>, read back from the token shards as the encode laid them out."""
    from shardline.core.encoding.text import EOS_ID, SEP_ID, lay_out
    from shardline.tasks.evaluate import test_pairs
    from shardline.trainer.data import SplitData

    sources = [[5, 6, 7], [8], [9, 10, 11, 12, 13, 14]]
    targets = [[20, 21], [22, 23, 24], [25]]
    piece = lambda rows: (np.array([t for r in rows for t in r], np.int64), np.array([len(r) for r in rows]))
    tokens, target, offsets = lay_out([piece(sources), piece(targets)], 3, np.arange(3), 4, True, np.dtype(np.uint16))
    arrays = {"cont": np.zeros((len(tokens), 0), np.float32), "cat": tokens[:, None], "target": target}
    data = SplitData([{**arrays, "offsets": offsets}], 4, 1, positions="all")
    pairs = test_pairs(data, 10, SEP_ID, EOS_ID)
    assert pairs == [(s + [SEP_ID], t) for s, t in zip(sources, targets)]
    assert test_pairs(data, 2, SEP_ID, EOS_ID) == pairs[:2]


def test_a_text_cut_by_its_token_budget_inside_a_character_ends_before_it():
    """A character of several bytes takes several byte-level tokens: a continuation whose max_tokens ran out inside
    one ended in U+FFFD; it ends before that character (a text that ended whole keeps what it decodes to)."""
    from shardline.core.encoding.text import decode, tokenizer, train_bpe
    from shardline.trainer.generate import cut_whole

    tok = train_bpe(["hello there"] * 20, 270)
    ids = tokenizer(tok).encode("hi 雪", add_special_tokens=False).ids  # 雪: three bytes, three tokens here
    assert decode(tok, ids) == "hi 雪" and decode(tok, ids[:-1]).endswith("\ufffd")
    assert cut_whole(decode(tok, ids[:-1]), cut=True) == "hi "
    assert cut_whole(decode(tok, ids), cut=True) == "hi 雪" and cut_whole("x\ufffd", cut=False) == "x\ufffd"


def test_a_continuation_that_runs_into_the_next_row_reads_as_lines():
    """A model of rows (a chat, a book's lines) writes a row's end, `<sep>`, and goes on: decoded for `generated`, the
    rows are lines (special tokens are no text: they ran together, 'it's谢谢你')."""
    from shardline.core.encoding.text import EOS_ID, SEP_ID, decode, tokenizer, train_bpe

    tok = train_bpe(["hello there", "thank you"] * 20, 270)
    a, b = (tokenizer(tok).encode(t, add_special_tokens=False).ids for t in ("hello there", "thank you"))
    assert decode(tok, [*a, SEP_ID, *b, SEP_ID], rows=True) == "hello there\nthank you\n"
    assert decode(tok, [*a, SEP_ID, *b]) == "hello therethank you"  # a source or reference as it was, rows off
    assert decode(tok, [*a, EOS_ID], rows=True) == "hello there"
