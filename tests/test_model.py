"""The model on the paged cache against the contiguous-cache oracle, and the GGUF loading.

Most tests use a randomly initialised tiny Llama (two layers, the real code path); a few load
SmolLM2-135M-Instruct itself. Seeds are fixed and printed in the test ids.
"""
import importlib.metadata

import numpy as np
import pytest

from pagedkv import backend
from pagedkv.errors import ConfigError
from pagedkv.model import Llama, LlamaConfig, PagedKV, forward, gguf, random_weights
from pagedkv.model import llama as llama_mod
from pagedkv.model.blas import single_thread_blas
from pagedkv.model.llama import Batch
from pagedkv.model.reference import ContiguousCache, reference_forward
from _tiny import TINY

single_thread_blas()

SEED = 1234


def _prompts(seed, lengths=(5, 17, 1, 33), vocab=96):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, n).astype(np.int32) for n in lengths]


def _prefill_batch(kv, seqs, chunks):
    """A Batch for appending ``chunks[i]`` (token arrays) to sequence ``seqs[i]``."""
    m = kv.manager
    plans = [m.append(s, len(c)) for s, c in zip(seqs, chunks)]
    tables = [m.block_table(s) for s in seqs]
    bt = np.full((len(seqs), max(map(len, tables))), -1, np.int32)
    for row, t in zip(bt, tables):
        row[:len(t)] = t
    lens = np.array([m.num_tokens(s) for s in seqs], np.int32)
    qlens = np.array([len(c) for c in chunks], np.int32)
    pos = np.concatenate([np.arange(L - q, L) for L, q in zip(lens, qlens)]).astype(np.int32)
    return Batch(np.concatenate(chunks).astype(np.int32), pos,
                 np.concatenate([p.slots for p in plans]), qlens, lens, bt,
                 np.concatenate([p.copies for p in plans]).reshape(-1, 2))


@pytest.mark.parametrize("block_size", [16, 1])
def test_logits_equal_contiguous_reference(tiny, block_size):
    """Prefill of 4 prompts of different lengths, then 20 greedy decode steps: every logit
    through the paged cache within 1e-4 of the contiguous cache; audit after every step."""
    prompts = _prompts(SEED)
    kv = PagedKV.for_model(tiny, num_blocks=200, block_size=block_size)
    m = kv.manager
    refs = [ContiguousCache(TINY.layers, TINY.kv_heads, TINY.head_dim) for _ in prompts]
    for s in range(len(prompts)):
        m.add(s)
    logits = forward(tiny, kv, _prefill_batch(kv, list(range(4)), prompts))
    m.audit()
    expect = np.stack([reference_forward(tiny, c, p)[-1] for c, p in zip(refs, prompts)])
    worst = np.abs(logits - expect).max()
    tokens = expect.argmax(axis=1)
    assert np.array_equal(logits.argmax(axis=1), tokens)
    for _ in range(20):
        plan = m.step()
        batch = Batch(tokens.astype(np.int32), plan.seq_lens - 1, plan.slot_mapping,
                      np.ones(4, np.int32), plan.seq_lens, plan.block_tables, plan.copies)
        logits = forward(tiny, kv, batch)
        m.audit()
        expect = np.concatenate([reference_forward(tiny, c, [t]) for c, t in zip(refs, tokens)])
        worst = max(worst, np.abs(logits - expect).max())
        assert np.array_equal(logits.argmax(axis=1), expect.argmax(axis=1))
        tokens = expect.argmax(axis=1)
    assert worst <= 1e-4, worst
    assert len(set(tokens.tolist())) > 1          # the four sequences really differ
    for s in range(4):
        m.free(s)
    m.audit()
    assert kv.allocator.num_free == kv.allocator.num_blocks


def test_decode_uses_the_kernel_at_block_size_16_and_the_gather_at_1(tiny, monkeypatch):
    calls = []
    real = llama_mod.paged_decode_attention
    monkeypatch.setattr(llama_mod, "paged_decode_attention",
                        lambda *a, **k: calls.append(1) or real(*a, **k))
    for block_size, expected in ((16, TINY.layers), (1, 0)):
        calls.clear()
        kv = PagedKV.for_model(tiny, num_blocks=64, block_size=block_size)
        kv.manager.add(0)
        forward(tiny, kv, _prefill_batch(kv, [0], [np.array([1, 2, 3], np.int32)]))
        plan = kv.manager.step()
        forward(tiny, kv, Batch(np.array([4], np.int32), plan.seq_lens - 1, plan.slot_mapping,
                                np.ones(1, np.int32), plan.seq_lens, plan.block_tables,
                                plan.copies))
        assert len(calls) == expected


@pytest.mark.parametrize("block_size", [16, 1])
def test_prefill_from_a_cached_prefix(tiny, block_size):
    """A prompt written in three chunks (each attending over the K/V already in the cache)
    gives the logits of writing it whole."""
    prompt = _prompts(SEED + 1, lengths=(40,))[0]
    kv = PagedKV.for_model(tiny, num_blocks=64, block_size=block_size)
    kv.manager.add("s")
    for chunk in (prompt[:7], prompt[7:16], prompt[16:]):
        logits = forward(tiny, kv, _prefill_batch(kv, ["s"], [chunk]))
    cache = ContiguousCache(TINY.layers, TINY.kv_heads, TINY.head_dim)
    expect = reference_forward(tiny, cache, prompt)[-1]
    assert np.abs(logits[0] - expect).max() <= 1e-4


def test_fork_copies_the_shared_last_block_before_writing(tiny):
    """Two children of a 20-token sequence (block size 16) write their own next tokens: the
    shared, partly filled block is copied first, in every layer, and both see the right K/V."""
    prompt = _prompts(SEED + 2, lengths=(20,))[0]
    kv = PagedKV.for_model(tiny, num_blocks=16, block_size=16)
    m = kv.manager
    m.add("p")
    forward(tiny, kv, _prefill_batch(kv, ["p"], [prompt]))
    m.fork("p", "c")
    plan = m.step(["p", "c"])
    assert plan.copies.shape == (1, 2)
    nxt = np.array([5, 9], np.int32)
    logits = forward(tiny, kv, Batch(nxt, plan.seq_lens - 1, plan.slot_mapping,
                                     np.ones(2, np.int32), plan.seq_lens, plan.block_tables,
                                     plan.copies))
    assert kv.copies_done == 1
    for row, t in enumerate(nxt):
        c = ContiguousCache(TINY.layers, TINY.kv_heads, TINY.head_dim)
        expect = reference_forward(tiny, c, np.append(prompt, t))[-1]
        assert np.abs(logits[row] - expect).max() <= 1e-4
    m.audit()


def test_layers_are_contiguous_views_of_one_pool(tiny):
    kv = PagedKV.for_model(tiny, num_blocks=8, block_size=16)
    spec = tiny.kv_spec()
    assert spec.bytes_per_token == 2 * TINY.layers * TINY.kv_heads * TINY.head_dim * 4
    assert len(kv.layers) == TINY.layers
    for layer in kv.layers:
        assert layer.shape == (8, 2, 16, TINY.kv_heads, TINY.head_dim)
        assert layer.flags.c_contiguous and np.shares_memory(layer, kv.allocator.pool)
    assert sum(a.nbytes for a in kv.layers) == kv.allocator.pool_bytes


def test_smollm2_bytes_per_token():
    spec = LlamaConfig(49152, 576, 30, 9, 3, 64, 1536).kv_spec("float16")
    assert spec.bytes_per_token == 30 * 2 * 3 * 64 * 2 == 23_040


def test_config_rejects_heads_not_a_multiple_of_kv_heads():
    with pytest.raises(ConfigError, match="multiple of kv_heads"):
        LlamaConfig(96, 64, 2, heads=4, kv_heads=3, head_dim=64, ffn=128)


def test_unpermute_inverts_the_converters_permutation():
    rng = np.random.default_rng(SEED)
    w = rng.standard_normal((3 * 64, 10))
    heads = 3
    permuted = w.reshape(heads, 2, 32, 10).swapaxes(1, 2).reshape(w.shape)  # the converter's
    assert np.array_equal(gguf.unpermute(permuted, heads), w)


def test_missing_model_names_the_setup_command(monkeypatch):
    monkeypatch.delenv(gguf.ENV_VAR, raising=False)

    def missing(name):
        raise importlib.metadata.PackageNotFoundError(name)
    monkeypatch.setattr(gguf.importlib.metadata, "distribution", missing)
    with pytest.raises(gguf.ModelNotFound, match="bash scripts/setup.sh"):
        gguf.model_path()


def test_env_var_pointing_nowhere(monkeypatch, tmp_path):
    monkeypatch.setenv(gguf.ENV_VAR, str(tmp_path / "nothing.gguf"))
    with pytest.raises(gguf.ModelNotFound, match=gguf.ENV_VAR):
        gguf.model_path()


def test_wrong_file_fails_the_checksum(tmp_path):
    f = tmp_path / "fake.gguf"
    f.write_bytes(b"GGUF not really")
    with pytest.raises(gguf.ModelNotFound, match="sha256"):
        gguf.load_gguf(f)


# ---------------------------------------------------------------------- the real model

@pytest.fixture(scope="module")
def smollm2():
    from pagedkv.model import Tokenizer, load_gguf
    ckpt = load_gguf()
    return ckpt, Tokenizer.from_checkpoint(ckpt), Llama(ckpt.config, ckpt.weights, xp=np)


def test_real_config(smollm2):
    c = smollm2[0].config
    assert (c.layers, c.hidden, c.heads, c.kv_heads, c.head_dim, c.ffn, c.vocab_size,
            c.context) == (30, 576, 9, 3, 64, 1536, 49152, 8192)
    assert c.rope_base == 100000.0 and abs(c.norm_eps - 1e-5) < 1e-9


def test_chat_template_matches_the_files_jinja_template(smollm2):
    jinja2 = pytest.importorskip("jinja2")
    from pagedkv.model.tokenizer import chat_prompt
    ckpt, tok, _ = smollm2
    template = jinja2.Template(ckpt.chat_template)
    q = "What is the capital of France?"
    assert chat_prompt(q) == template.render(
        messages=[{"role": "user", "content": q}], add_generation_prompt=True)
    assert chat_prompt(q, "Be brief.") == template.render(
        messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": q}],
        add_generation_prompt=True)


def test_tokenizer_round_trip_and_special_tokens(smollm2):
    _, tok, _ = smollm2
    text = "Paging 1,024 tokens: naïve? 𝛑 ≈ 3.14159 — done."
    assert tok.decode(tok.encode(text)) == text
    assert tok.encode("<|im_start|>user\n") [0] == 1 and tok.token(tok.eos_id) == "<|im_end|>"
    assert tok.encode("2024") == [tok.encode(d)[0] for d in "2024"]  # digits one by one


def test_real_model_greedy_paris_and_identical_to_reference(smollm2):
    from pagedkv.model.engine import Engine
    from pagedkv.model.reference import reference_generate
    from pagedkv.model.requests import SamplingParams
    _, tok, model = smollm2
    prompt = tok.chat("What is the capital of France?")
    params = SamplingParams(max_new_tokens=12)
    engine = Engine(model, num_blocks=8, block_size=16, stop_ids=[tok.eos_id], audit=True)
    (req,) = engine.generate([prompt], params)
    answer = req.outputs()[0].generated
    assert "Paris" in tok.decode(answer)
    assert answer == reference_generate(model, prompt, params, [tok.eos_id])[0].generated
    assert engine.memory.manager.allocator.num_free == 8


# ---------------------------------------------------------------------- on a GPU

on_gpu = pytest.mark.skipif(not backend.on_gpu, reason=f"no GPU: {backend.reason}")


@on_gpu
def test_cupy_float32_generation_equals_reference(tiny):
    """The CuPy path (kernels, float32) gives the NumPy oracle's greedy tokens and beams."""
    from pagedkv.model.engine import Engine
    from pagedkv.model.reference import reference_generate
    from pagedkv.model.requests import SamplingParams
    gpu = Llama(TINY, random_weights(TINY, SEED), xp=backend.xp, dtype=np.float32)
    prompts = [p.tolist() for p in _prompts(SEED)]
    for params in (SamplingParams(max_new_tokens=20), SamplingParams(max_new_tokens=12,
                                                                      beam_width=4)):
        engine = Engine(gpu, num_blocks=300, block_size=16, stop_ids=(0,), audit=True)
        for req, p in zip(engine.generate(prompts, params), prompts):
            expect = reference_generate(tiny, p, params, (0,))
            assert [s.generated for s in req.outputs()] == [s.generated for s in expect]
            assert np.allclose([s.score for s in req.outputs()], [s.score for s in expect],
                               atol=1e-3)
        assert engine.memory.manager.allocator.num_free == 300


@on_gpu
def test_cupy_float16_real_model_names_paris(smollm2):
    from pagedkv.model.engine import Engine
    from pagedkv.model.requests import SamplingParams
    ckpt, tok, _ = smollm2
    model = Llama(ckpt.config, ckpt.weights)            # float16 on the GPU
    assert model.dtype == np.float16
    engine = Engine(model, num_blocks=8, block_size=16, stop_ids=[tok.eos_id], audit=True)
    (req,) = engine.generate([tok.chat("What is the capital of France?")],
                             SamplingParams(max_new_tokens=12))
    assert "Paris" in tok.decode(req.outputs()[0].generated)
