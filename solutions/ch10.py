"""Chapter 10 (a real model): the KV bytes of another model from its configuration, and a greedy
decode loop written without the engine."""
from __future__ import annotations

import random

import numpy as np

from pagedkv import backend
from pagedkv.model import Batch, Llama, LlamaConfig, PagedKV, forward, random_weights
from pagedkv.model.reference import reference_generate
from pagedkv.model.requests import SamplingParams
from pagedkv.spec import KVSpec

from ._seeds import names_its_seed

__all__ = ["kv_spec_from_hf", "greedy_paged"]


def kv_spec_from_hf(config: dict) -> KVSpec:
    """The KV cache's shape for a Llama-style Hugging Face ``config.json`` (a dict).

    A config without ``num_key_value_heads`` is multi-head attention: as many K/V
    heads as query heads. A config without ``head_dim`` splits ``hidden_size``
    evenly over the query heads; one that has it may say otherwise (Qwen3 does)."""
    heads = config["num_attention_heads"]
    return KVSpec(layers=config["num_hidden_layers"],
                  kv_heads=config.get("num_key_value_heads", heads),
                  head_dim=config.get("head_dim", config["hidden_size"] // heads),
                  dtype=config.get("torch_dtype", "float32"))


def _prefill(manager, prompt) -> Batch:
    """The prompt as one forward pass: every token at its position, written at its slot."""
    n = len(prompt)
    plan = manager.add(0, n)
    return Batch(tokens=np.asarray(prompt, np.int32), positions=np.arange(n, dtype=np.int32),
                 slots=plan.slots, query_lens=np.array([n], np.int32),
                 seq_lens=np.array([n], np.int32), block_tables=manager.block_table(0)[None],
                 copies=plan.copies)


def greedy_paged(model: Llama, prompt, max_new_tokens: int, *, num_blocks: int = 64,
                 block_size: int = 16) -> list:
    """Greedy decoding of one prompt on the paged cache, without the engine: a
    prefill pass, then for every new token one manager step and one forward pass.
    Returns the new tokens."""
    kv = PagedKV.for_model(model, num_blocks, block_size)
    batch, out = _prefill(kv.manager, prompt), []
    while True:
        logits = forward(model, kv, batch)                  # of the last token fed
        out.append(int(backend.to_numpy(logits).argmax()))
        if len(out) == max_new_tokens:
            break
        plan = kv.manager.step([0])           # a slot for the token just chosen
        batch = Batch(tokens=np.array(out[-1:], np.int32),
                      positions=plan.seq_lens - 1, slots=plan.slot_mapping,
                      query_lens=np.ones(1, np.int32), seq_lens=plan.seq_lens,
                      block_tables=plan.block_tables, copies=plan.copies)
    kv.manager.free(0)
    kv.manager.audit()
    return out


# ------------------------------------------------------------------------------------ checks
#: Hugging Face config.json fields of real models (the fields read here, copied from the files)
#: with their K/V bytes per token worked out by hand: 2 (K and V) x layers x kv_heads x
#: head_dim x bytes per number.
KNOWN = {
    "Qwen/Qwen3-0.6B": ({"hidden_size": 1024, "num_attention_heads": 16, "num_hidden_layers": 28,
                         "num_key_value_heads": 8, "head_dim": 128, "torch_dtype": "bfloat16"},
                        2 * 28 * 8 * 128 * 2),
    "microsoft/Phi-3-mini-4k-instruct": ({"hidden_size": 3072, "num_attention_heads": 32,
                                          "num_hidden_layers": 32, "num_key_value_heads": 32,
                                          "torch_dtype": "bfloat16"}, 2 * 32 * 32 * 96 * 2),
}


@names_its_seed
def check_kv_spec_from_hf(impl=kv_spec_from_hf, seed=12, trials=300):
    """Hand-worked bytes per token for two real configurations, then random configurations
    with and without the optional fields against the formula written out."""
    for name, (config, want) in KNOWN.items():
        assert impl(config).bytes_per_token == want, name
    rng = random.Random(seed)
    sizes = {"float16": 2, "bfloat16": 2, "float32": 4}
    for _ in range(trials):
        heads = rng.choice([4, 8, 16, 32])
        config = {"hidden_size": heads * rng.choice([32, 64, 128]), "num_attention_heads": heads,
                  "num_hidden_layers": rng.randrange(1, 80),
                  "torch_dtype": rng.choice(list(sizes))}
        kv, dim = heads, config["hidden_size"] // heads
        if rng.random() < 0.5:
            kv = config["num_key_value_heads"] = heads // rng.choice([1, 2, 4])
        if rng.random() < 0.5:
            dim = config["head_dim"] = rng.choice([64, 128, 256])
        want = 2 * config["num_hidden_layers"] * kv * dim * sizes[config["torch_dtype"]]
        assert impl(config).bytes_per_token == want, config
    return {"configs": trials + len(KNOWN)}


#: The tiny random Llama of the tests (two layers), fast enough for CI.
TINY = LlamaConfig(vocab_size=96, hidden=64, layers=2, heads=4, kv_heads=2, head_dim=64,
                   ffn=128, rope_base=10000.0, context=512)


@names_its_seed
def check_greedy_paged(impl=greedy_paged, seed=1234, prompts=4, new_tokens=24):
    """Token for token against ``reference_generate`` (one contiguous cache, no paging) on a
    tiny random Llama, at block sizes 1, 4 and 16 (16 decodes with the paged kernel)."""
    model = Llama(TINY, random_weights(TINY, seed), xp=np)
    rng = np.random.default_rng(seed)
    for n in rng.integers(1, 40, prompts).tolist():
        prompt = rng.integers(0, TINY.vocab_size, n).tolist()
        (want,) = reference_generate(model, prompt, SamplingParams(max_new_tokens=new_tokens))
        for bs in (1, 4, 16):
            got = impl(model, prompt, new_tokens, num_blocks=64, block_size=bs)
            assert list(got) == want.generated, (n, bs, got, want.generated)
    return {"prompts": prompts, "tokens each": new_tokens}


# ---------------------------------------------------- wrong answers the checks must reject
def _every_config_multi_head(config):
    heads = config["num_attention_heads"]
    return KVSpec(config["num_hidden_layers"], heads,
                  config.get("head_dim", config["hidden_size"] // heads),
                  config.get("torch_dtype", "float32"))


def _head_dim_from_hidden(config):
    heads = config["num_attention_heads"]
    return KVSpec(config["num_hidden_layers"], config.get("num_key_value_heads", heads),
                  config["hidden_size"] // heads, config.get("torch_dtype", "float32"))


def _greedy_decode_positions_one_late(model, prompt, max_new_tokens, *, num_blocks=64, block_size=16):
    kv = PagedKV.for_model(model, num_blocks, block_size)
    batch, out = _prefill(kv.manager, prompt), []
    while True:
        out.append(int(np.asarray(forward(model, kv, batch)).argmax()))
        if len(out) == max_new_tokens:
            return out
        plan = kv.manager.step([0])
        batch = Batch(np.array(out[-1:], np.int32), plan.seq_lens, plan.slot_mapping,
                      np.ones(1, np.int32), plan.seq_lens, plan.block_tables, plan.copies)


def _greedy_feeding_the_last_prompt_token(model, prompt, max_new_tokens, *, num_blocks=64,
                                          block_size=16):
    kv = PagedKV.for_model(model, num_blocks, block_size)
    batch, out = _prefill(kv.manager, prompt), []
    while True:
        out.append(int(np.asarray(forward(model, kv, batch)).argmax()))
        if len(out) == max_new_tokens:
            return out
        plan = kv.manager.step([0])
        batch = Batch(np.array(prompt[-1:], np.int32), plan.seq_lens - 1, plan.slot_mapping,
                      np.ones(1, np.int32), plan.seq_lens, plan.block_tables, plan.copies)


WRONG = {
    "kv_spec_from_hf": [_every_config_multi_head, _head_dim_from_hidden],
    "greedy_paged": [_greedy_decode_positions_one_late, _greedy_feeding_the_last_prompt_token],
}
