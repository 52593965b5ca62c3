"""The "solattn" transformers backend (solattn/integrations/transformers.py).

Tiny randomly initialized models built from configs (no downloads): Llama (GQA), Qwen3 (one full
and one sliding layer), Mistral (sliding window), Gemma 2 (window + softcap, head dim 256) and
gpt-oss (sinks + window). Each model's weights are rounded to the test dtype once, so the
solattn model, the reference and its low-precision twin hold identical weights:

* reference: transformers' own ``"eager"`` attention in float32 (float64 eager turns padded rows
  into NaN: its float32 softmax upcast sends the float64 mask minimum to -inf);
* twin: ``"eager"`` in the test dtype, i.e. what transformers itself loses in that precision;
* rule (tests/oracle.py): ``|solattn - ref| <= 2 * |twin - ref| + eps`` on logits and gradients.

The attention function is also tested on its own against transformers' ``sdpa_mask`` (the boolean
mask eager/sdpa would use) through solattn.reference.masked_attention_ref: static-cache slots
holding NaN, decode, sliding-window caches, bidirectional windows, packed sequences, softcap
and sinks.

CPU (interpreter): fp16, batch 2, 9 tokens, window 4. GPU: bf16 and fp16, 67 tokens, window 16.
"""

from __future__ import annotations

import functools
import os

import pytest
import torch

transformers = pytest.importorskip("transformers", minversion="5.0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from oracle import DEVICE, DTYPES, GPU_GRID, ON_GPU, assert_close  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402
from transformers import masking_utils as mu  # noqa: E402

import solattn.integrations.transformers as hf  # noqa: E402
from solattn.reference import masked_attention_ref  # noqa: E402

SEQ, WINDOW, PAD = (67, 16, 19) if ON_GPU else (9, 4, 3)
VOCAB = 128
# initializer_range 0.2 makes attention peaked (scores ~10), so a wrong mask, window, softcap or
# sink changes the logits far more than rounding does.
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, head_dim=16,
              max_position_embeddings=256, initializer_range=0.2, attention_dropout=0.0,
              pad_token_id=0, bos_token_id=1, eos_token_id=None, tie_word_embeddings=False)
MODELS = {
    "llama": ("LlamaConfig", dict()),
    "qwen3": ("Qwen3Config", dict(use_sliding_window=True, sliding_window=WINDOW,
                                  max_window_layers=1)),
    "mistral": ("MistralConfig", dict(sliding_window=WINDOW)),
    "gemma2": ("Gemma2Config", dict(head_dim=256, num_attention_heads=2, num_key_value_heads=1,
                                    sliding_window=WINDOW, attn_logit_softcapping=5.0,
                                    final_logit_softcapping=30.0, query_pre_attn_scalar=64)),
    # top-k routing over all experts stays continuous: rounding cannot flip an expert choice
    # between the solattn model and the reference
    "gpt_oss": ("GptOssConfig", dict(sliding_window=WINDOW, num_local_experts=2,
                                     num_experts_per_tok=2, intermediate_size=64,
                                     rope_parameters=dict(rope_type="default", rope_theta=1e4))),
}
# CPU: llama (plain), gemma2 (softcap, sliding and global layers, head dim 256) and gpt_oss
# (sinks, sliding layers) run every attention path: qwen3 and mistral add only sliding layers
MODEL_NAMES = [n if n in ("llama", "gemma2", "gpt_oss") else pytest.param(n, marks=GPU_GRID)
               for n in MODELS]
SINKS = [1.5, -1.0, 0.5, 2.0]  # gpt-oss sink logits per head (random init gives ~0.2)


def _config(name):
    cls_name, kw = MODELS[name]
    cls = getattr(transformers, cls_name, None)
    if cls is None:
        pytest.skip(f"transformers {transformers.__version__} has no {cls_name}")
    return cls(**{**COMMON, **kw})


@functools.lru_cache(maxsize=None)
def _weights(name, dtype):
    """State dict of a seeded random model, rounded to ``dtype`` (exactly representable)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(1234)
        model = AutoModelForCausalLM.from_config(_config(name), attn_implementation="eager")
    if name == "gpt_oss":
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.sinks.copy_(torch.tensor(SINKS))
    return {k: v.to(dtype) if v.is_floating_point() else v
            for k, v in model.state_dict().items()}


def _model(name, dtype, impl, weights_dtype=None):
    """The model in ``dtype`` with attn_implementation ``impl``, weights of ``weights_dtype``."""
    model = AutoModelForCausalLM.from_config(_config(name), attn_implementation=impl, dtype=dtype)
    model.load_state_dict(_weights(name, weights_dtype or dtype))
    return model.to(DEVICE).eval()


def _trio(name, dtype):
    """(solattn model, float32 eager reference, eager twin in ``dtype``), identical weights."""
    return (_model(name, dtype, hf.NAME), _model(name, torch.float32, "eager", dtype),
            _model(name, dtype, "eager"))


def _left_padded_batch():
    ids = torch.randint(2, VOCAB, (2, SEQ), device=DEVICE)
    am = torch.ones(2, SEQ, dtype=torch.long, device=DEVICE)
    am[1, :PAD] = 0
    ids[1, :PAD] = 0
    return ids, am


# ----------------------------------------------------------------------------- whole models

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", MODEL_NAMES)
def test_logits_left_padded(name, dtype):
    sol, ref, twin = _trio(name, dtype)
    ids, am = _left_padded_batch()
    valid = am.bool()
    with torch.no_grad():
        out, hi, lo = (m(ids, attention_mask=am).logits[valid] for m in (sol, ref, twin))
    assert out.dtype == dtype and torch.isfinite(out).all()
    assert_close("logits", out, hi, lo, eps=1e-4)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", MODEL_NAMES)
def test_loss_backward(name, dtype):
    """Gradients of the language-model loss on a left-padded batch, every parameter."""
    models = _trio(name, dtype)
    ids, am = _left_padded_batch()
    labels = ids.masked_fill(am == 0, -100)
    # The first real token of a left-padded row is predicted from a padding position, whose
    # output is garbage in eager (a uniform average) and 0 here: leave it out of the loss.
    labels[1, PAD] = -100
    grads = []
    for m in models:
        m.train()
        m(ids, attention_mask=am, labels=labels).loss.backward()
        grads.append(torch.cat([p.grad.double().flatten() for p in m.parameters()]))
    sol_grads = dict(models[0].named_parameters())
    if name == "gpt_oss":  # the sinks are learned: their gradient must flow
        assert all(sol_grads[f"model.layers.{i}.self_attn.sinks"].grad.abs().sum() > 0
                   for i in range(2))
    assert_close("grads", grads[0], grads[1], grads[2], eps=1e-4)


def _check_generation(out, ids, am, ref, twin):
    """Check greedy decoding numerically, not by tokens (tiny random models have top-2 logit
    margins of a few 1e-3, which bf16 rounding may flip): the logits ``generate`` produced at each
    step against one teacher-forced forward of the reference and its twin over the generated
    sequence, with the same position ids ``generate`` used."""
    seq, n_new = out.sequences, len(out.logits)
    full_am = torch.cat([am, am.new_ones(am.shape[0], n_new)], 1)[:, :-1]
    pos = (full_am.cumsum(-1) - 1).masked_fill(full_am == 0, 1)
    with torch.no_grad():
        hi, lo = (m(seq[:, :-1], attention_mask=full_am, position_ids=pos).logits[:, -n_new:]
                  for m in (ref, twin))
    assert_close("generated logits", torch.stack(out.logits, 1), hi, lo, eps=1e-4)


GENERATE = dict(max_new_tokens=6 if ON_GPU else 4, do_sample=False, pad_token_id=0,
                output_logits=True, return_dict_in_generate=True)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", MODEL_NAMES)
def test_generate_dynamic_static(name, dtype):
    """Greedy generation from a left-padded batch: a static cache (whose unfilled slots must stay
    masked) gives the tokens of a dynamic cache, and the logits of both match the reference."""
    sol, ref, twin = _trio(name, dtype)
    ids, am = _left_padded_batch()
    dyn = sol.generate(ids, attention_mask=am, **GENERATE)
    static = sol.generate(ids, attention_mask=am, cache_implementation="static",
                          disable_compile=True, **GENERATE)
    assert torch.equal(dyn.sequences, static.sequences), \
        f"dynamic {dyn.sequences[:, SEQ:].tolist()} != static {static.sequences[:, SEQ:].tolist()}"
    _check_generation(dyn, ids, am, ref, twin)
    _check_generation(static, ids, am, ref, twin)


@pytest.mark.parametrize("mask", ["none", "ones"])
@pytest.mark.parametrize("name", ["llama", "gpt_oss"])
def test_static_cache_stepwise(name, mask, dtype=DTYPES[0]):
    """Three forwards on one StaticCache without padding (no attention_mask, or an all-ones
    one): the unfilled slots must still be cut off. Logits of the whole sequence as one uncached
    forward computes them."""
    sol, ref, twin = _trio(name, dtype)
    ids = _left_padded_batch()[0]
    cache = transformers.StaticCache(config=sol.config, max_cache_len=SEQ + 5)
    with torch.no_grad():
        steps = []
        # 2 tokens: a sliding layer's static buffer (WINDOW slots) is not yet full; then a chunk
        # that fills it past the window (chunked prefill, q_len > 1 after a cache); then decode.
        for a, b in ((0, 2), (2, SEQ - 1), (SEQ - 1, SEQ)):
            am = torch.ones_like(ids[:, :b]) if mask == "ones" else None
            steps.append(sol(ids[:, a:b], attention_mask=am, past_key_values=cache,
                             use_cache=True).logits)
        hi, lo = (m(ids, use_cache=False).logits for m in (ref, twin))
    assert_close("logits", torch.cat(steps, 1), hi, lo, eps=1e-4)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["llama", "gpt_oss"])
def test_generate_static_autocompile(name):
    """generate() with a static cache on CUDA compiles the decode step itself (torch.compile,
    mode="reduce-overhead"): it must run through solattn and give the reference's logits."""
    sol, ref, twin = _trio(name, torch.bfloat16)
    ids, am = _left_padded_batch()
    out = sol.generate(ids, attention_mask=am, cache_implementation="static", **GENERATE)
    _check_generation(out, ids, am, ref, twin)


def _packed_inputs(lengths):
    ids = torch.randint(2, VOCAB, (1, sum(lengths)), device=DEVICE)
    pos = torch.cat([torch.arange(n, device=DEVICE) for n in lengths])[None]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], device=DEVICE)
    return ids, pos, cu


@pytest.mark.parametrize("how", ["position_ids", "cu_seq_lens"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", MODEL_NAMES)
def test_packed_sequences(name, dtype, how):
    """Sequences packed in one row give the logits of each sequence run alone."""
    sol, ref, twin = _trio(name, dtype)
    lengths = [SEQ - PAD, PAD + 2, 1]
    ids, pos, cu = _packed_inputs(lengths)
    kw = dict(position_ids=pos)
    if how == "cu_seq_lens":
        kw.update(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=max(lengths),
                  max_length_k=max(lengths))
    with torch.no_grad():
        out = sol(ids, **kw).logits[0]
        alone = [[m(ids[:, a:b]).logits[0] for a, b in zip(cu[:-1].tolist(), cu[1:].tolist())]
                 for m in (ref, twin)]
    assert_close("logits", out, torch.cat(alone[0]), torch.cat(alone[1]), eps=1e-4)


def test_set_attn_implementation():
    """Registered under "solattn" (idempotently); a model built with sdpa switches to it."""
    hf.register()
    assert transformers.AttentionInterface()[hf.NAME] is hf.solattn_attention_forward
    assert hf.NAME in transformers.AttentionInterface().valid_keys()
    assert hf.NAME in mu.AttentionMaskInterface().valid_keys()
    assert "flash" not in hf.NAME
    dtype = DTYPES[0]
    model = _model("llama", dtype, "sdpa")
    ids, am = _left_padded_batch()
    with torch.no_grad():
        before = model(ids, attention_mask=am).logits
        model.set_attn_implementation(hf.NAME)
        assert model.config._attn_implementation == hf.NAME
        after = model(ids, attention_mask=am).logits
    valid = am.bool()
    assert (after[valid].float() - before[valid].float()).abs().max() < 0.05


def test_training_with_attention_dropout():
    """``attention_dropout > 0`` in train(): solattn's dropout runs (reproducible under
    ``torch.manual_seed``, fresh on the next step, finite gradients); eval() passes 0.0."""
    model = AutoModelForCausalLM.from_config(
        _config("llama").__class__(**{**COMMON, "attention_dropout": 0.3}),
        attn_implementation=hf.NAME, dtype=DTYPES[0]).to(DEVICE).train()
    ids, am = _left_padded_batch()
    valid = am.bool()
    logits = []
    for seed in (5, 5, 6):
        torch.manual_seed(seed)
        out = model(ids, attention_mask=am, labels=ids)
        out.loss.backward()
        logits.append(out.logits.detach())
    assert torch.equal(logits[0], logits[1])
    assert not torch.equal(logits[0][valid], logits[2][valid])
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
    model.eval()
    with torch.no_grad():
        ev = model(ids, attention_mask=am).logits
        model.set_attn_implementation("eager")
        eager = model(ids, attention_mask=am).logits
        hi = model.float()(ids, attention_mask=am).logits
    assert not torch.equal(ev[valid], logits[0][valid])
    # No dropout in eval: the same 2x rule against the fp32 eager model as every logits test.
    assert_close("eval logits", ev[valid], hi[valid], eager[valid], eps=1e-4)


def test_attention_function_dropout_is_flash_attn_dropout():
    """The layer's ``dropout`` is ``dropout_p`` of flash_attn_func: the same mask."""
    from solattn import flash_attn_func

    q, k, v = _qkv(2, 4, 2, 5, 5, 16, DTYPES[0])
    torch.manual_seed(3)
    out, _ = hf.solattn_attention_forward(_Layer(), q, k, v, None, dropout=0.3)
    torch.manual_seed(3)
    ref = flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), 0.3,
                          causal=True)
    assert torch.equal(out, ref)


def test_output_attentions_raises():
    model = _model("llama", DTYPES[0], hf.NAME)
    ids, am = _left_padded_batch()
    with pytest.raises(NotImplementedError, match="output_attentions: .* never materializes"):
        with torch.no_grad():
            model(ids, attention_mask=am, output_attentions=True)


@pytest.mark.parametrize("kind", ["bool", "additive"])
def test_custom_4d_mask(kind):
    """A user's 4-D mask (two documents per row, causal inside each; the second row left
    padded) gives the reference's logits, as it would on the sdpa backend. (The eager references
    get the additive form: eager adds a mask to the scores, so a bool one would be 0/1.)"""
    dtype = DTYPES[0]
    sol, ref, twin = _trio("llama", dtype)
    ids, am = _left_padded_batch()
    i = torch.arange(SEQ, device=DEVICE)
    doc = (i >= SEQ // 2).long()
    allowed = (doc[:, None] == doc[None, :]) & (i[None, :] <= i[:, None])
    allowed = allowed[None, None] & am.bool()[:, None, None, :]
    allowed = allowed | torch.eye(SEQ, dtype=torch.bool, device=DEVICE)  # padded rows: no NaN
    valid = am.bool()
    outs = []
    for m in (sol, ref, twin):
        mask = allowed
        if kind == "additive" or m is not sol:
            dt = next(m.parameters()).dtype
            mask = torch.zeros(allowed.shape, dtype=dt, device=DEVICE).masked_fill(
                ~allowed, torch.finfo(dt).min)
        with torch.no_grad():
            outs.append(m(ids, attention_mask=mask).logits[valid])
    out, hi, lo = outs
    assert torch.isfinite(out).all()
    assert_close("logits", out, hi, lo, eps=1e-4)


def test_4d_mask_with_softcap_raises():
    model = _model("gemma2", DTYPES[0], hf.NAME)
    ids, _ = _left_padded_batch()
    mask4d = torch.ones(2, 1, SEQ, SEQ, dtype=torch.bool, device=DEVICE).tril()
    with pytest.raises(NotImplementedError, match="attention_mask: .* do not take softcap"):
        with torch.no_grad():
            model(ids, attention_mask=mask4d)


# ----------------------------------------------------------------------------- mask function

def test_mask_none_without_padding():
    am = torch.ones(2, 7, dtype=torch.bool, device=DEVICE)
    assert hf.solattn_mask(2, 7, 7, attention_mask=am,
                           mask_function=mu.causal_mask_function) is None
    assert hf.solattn_mask(2, 7, 7, mask_function=mu.causal_mask_function) is None
    # static cache: 12 slots, 5 filled after this forward -> the unfilled tail is cut off
    m = hf.solattn_mask(2, 2, 12, q_offset=3, mask_function=mu.causal_mask_function,
                        device=DEVICE)
    assert m.shape == (2, 5) and m.all()


def test_mask_refeed_with_kv_offset():
    """generate() builds masks ahead and some models feed them through the mask function again:
    with a sliding-window cache (kv_offset > 0) the result must not change."""
    am = torch.ones(2, 10, dtype=torch.bool, device=DEVICE)
    am[1, :6] = False
    fn = mu.sliding_window_causal_mask_function(4)
    assert hf.solattn_mask(2, 1, 4, q_offset=9, kv_offset=6, mask_function=fn,
                           attention_mask=am) is None  # the padding is outside the window
    am[1, :7] = False
    first = hf.solattn_mask(2, 1, 4, q_offset=9, kv_offset=6, mask_function=fn, attention_mask=am)
    assert first.tolist() == [[True] * 4, [False, True, True, True]]
    again = hf.solattn_mask(2, 1, 4, q_offset=9, kv_offset=6, mask_function=fn,
                            attention_mask=first)
    assert torch.equal(first, again)


@pytest.mark.parametrize("fn, match", [
    (mu.chunked_causal_mask_function(4, torch.zeros(2, dtype=torch.long)), "chunked attention"),
    (mu.or_masks(mu.causal_mask_function, lambda b, h, q, k: q >= 0), "a union of mask patterns"),
    (mu.and_masks(mu.causal_mask_function, lambda b, h, q, k: q >= 0), "custom mask function"),
    (lambda b, h, q, k: q >= k, "custom mask function"),
])
def test_mask_unsupported_patterns_raise(fn, match):
    with pytest.raises(NotImplementedError, match=match):
        hf.solattn_mask(2, 5, 5, mask_function=fn)


# ----------------------------------------------------------------------------- attention function

class _Layer(torch.nn.Module):
    is_causal = True


def _qkv(b, h, h_kv, s_q, s_k, d, dtype):
    q = torch.randn(b, h, s_q, d, device=DEVICE, dtype=dtype)
    k = torch.randn(b, h_kv, s_k, d, device=DEVICE, dtype=dtype)
    v = torch.randn(b, h_kv, s_k, d, device=DEVICE, dtype=dtype)
    return q, k, v


# name -> (q_len, kv_length, q_offset, kv_offset, filled padding mask rows, mask function, attention
# kwargs). Padding rows are given over absolute positions [0, q_offset + q_len).
UNIT = {
    "static-decode": (1, 12, 7, 0, [[1] * 8, [0] * 3 + [1] * 5], mu.causal_mask_function, {}),
    "static-prefill": (5, 12, 0, 0, [[1] * 5, [0] * 2 + [1] * 3], mu.causal_mask_function, {}),
    "static-window-chunk": (3, 12, 4, 0, [[1] * 7, [0] * 2 + [1] * 5],
                            mu.sliding_window_causal_mask_function(3), dict(sliding_window=3)),
    "sliding-cache-decode": (1, 4, 9, 6, [[1] * 10, [0] * 7 + [1] * 3],
                             mu.sliding_window_causal_mask_function(4), dict(sliding_window=4)),
    "right-padded-decode": (1, 6, 5, 0, [[1] * 6, [1, 1, 0, 0, 0, 1]], mu.causal_mask_function,
                            {}),
    "softcap-sinks": (6, 6, 0, 0, [[1] * 6, [0] * 4 + [1] * 2], mu.causal_mask_function,
                      dict(softcap=2.0, s_aux=True)),
    # transformers' bidirectional window keeps |i - j| <= w; models pass sliding_window = w + 1
    # for the flash-attn convention (ModernBERT does).
    "bidirectional-window": (7, 7, 0, 0, [[1] * 7, [1] * 4 + [0] * 3],
                             mu.sliding_window_bidirectional_mask_function(2),
                             dict(sliding_window=3, is_causal=False)),
    "bidirectional-sinks": (5, 5, 0, 0, [[0] + [1] * 4, [1] * 5], mu.bidirectional_mask_function,
                            dict(is_causal=False, s_aux=True)),
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", list(UNIT))
def test_attention_function(case, dtype):
    """solattn_mask + solattn_attention_forward == transformers' sdpa_mask + float64 attention;
    K/V slots of padding and unfilled static-cache slots hold NaN."""
    q_len, kv_length, q_offset, kv_offset, rows, fn, kw = UNIT[case]
    b, h, h_kv, d = 2, 4, 2, 16
    q, k, v = _qkv(b, h, h_kv, q_len, kv_length, d, dtype)
    am = torch.tensor(rows, dtype=torch.bool, device=DEVICE)
    kw = dict(kw)
    sinks = torch.tensor(SINKS, device=DEVICE) if kw.pop("s_aux", False) else None
    allowed = mu.sdpa_mask(batch_size=b, q_length=q_len, kv_length=kv_length, q_offset=q_offset,
                           kv_offset=kv_offset, mask_function=fn, attention_mask=am,
                           allow_is_causal_skip=False, device=DEVICE)  # (b, 1, q_len, kv_length)
    # padding and unfilled static-cache slots hold NaN (real tokens outside a window are finite)
    real_abs = torch.nn.functional.pad(am, (0, kv_offset + kv_length - am.shape[1]))
    dead = ~real_abs[:, kv_offset:, None, None]  # (b, kv_length, 1, 1)
    k = k.transpose(1, 2).masked_fill(dead, float("nan")).transpose(1, 2)
    v = v.transpose(1, 2).masked_fill(dead, float("nan")).transpose(1, 2)

    mask = hf.solattn_mask(b, q_len, kv_length, q_offset=q_offset, kv_offset=kv_offset,
                           mask_function=fn, attention_mask=am, device=DEVICE)
    out, weights = hf.solattn_attention_forward(_Layer(), q, k, v, mask, scaling=0.3, s_aux=sinks,
                                                **kw)
    assert weights is None and out.shape == (b, q_len, h, d) and out.dtype == dtype

    kz, vz = (t.transpose(1, 2).nan_to_num(0.0) for t in (k, v))
    ref = dict(softmax_scale=0.3, softcap=kw.get("softcap", 0.0), sinks=sinks)
    hi, _ = masked_attention_ref(q.transpose(1, 2), kz, vz, allowed, upcast=True, **ref)
    lo, _ = masked_attention_ref(q.transpose(1, 2), kz, vz, allowed, upcast=False, **ref)
    # Padded query rows are 0 here; transformers lets them attend (bidirectional) or leaves them
    # empty (causal): their outputs are never used, so only real query rows are compared.
    real = am[:, q_offset:q_offset + q_len]
    assert (out[~real] == 0).all()
    assert_close("out", out[real], hi[real], lo[real])


# name -> (mask function, attention kwargs) of an unpadded decode step (mask None)
DECODE = {
    "causal": (mu.causal_mask_function, {}),
    "window": (mu.sliding_window_causal_mask_function(4), dict(sliding_window=4)),
    "softcap-sinks": (mu.causal_mask_function, dict(softcap=2.0, s_aux=True)),
    "bidirectional": (mu.bidirectional_mask_function, dict(is_causal=False)),
}


@pytest.mark.parametrize("grad", [False, True], ids=["no_grad", "grad"])
@pytest.mark.parametrize("case", list(DECODE))
def test_decode_step(case, grad, monkeypatch):
    """An unpadded one-row step (attention_mask None, the K/V all real keys) gives the float64
    attention; without a gradient it runs as flash_attn_with_kvcache over the whole K/V (the
    decode kernel), with one through flash_attn_func (which has the backward), whose
    gradients reach q."""
    dtype = DTYPES[0]
    fn, kw = DECODE[case]
    b, h, h_kv, s_k, d = 2, 4, 2, 9, 16
    q, k, v = _qkv(b, h, h_kv, 1, s_k, d, dtype)
    kw = dict(kw)
    sinks = torch.tensor(SINKS, device=DEVICE) if kw.pop("s_aux", False) else None
    calls = []
    real = hf.flash_attn_with_kvcache
    monkeypatch.setattr(hf, "flash_attn_with_kvcache",
                        lambda *a, **k: calls.append(1) or real(*a, **k))
    q.requires_grad_(grad)
    out, _ = hf.solattn_attention_forward(_Layer(), q, k, v, None, scaling=0.3, s_aux=sinks,
                                          **kw)
    assert len(calls) == (0 if grad else 1)
    allowed = mu.sdpa_mask(batch_size=b, q_length=1, kv_length=s_k, q_offset=s_k - 1,
                           mask_function=fn, attention_mask=torch.ones(b, s_k, dtype=torch.bool,
                                                                       device=DEVICE),
                           allow_is_causal_skip=False, device=DEVICE)
    ref = dict(softmax_scale=0.3, softcap=kw.get("softcap", 0.0), sinks=sinks)
    qt, kt, vt = (t.detach().transpose(1, 2) for t in (q, k, v))
    hi, _ = masked_attention_ref(qt, kt, vt, allowed, upcast=True, **ref)
    lo, _ = masked_attention_ref(qt, kt, vt, allowed, upcast=False, **ref)
    assert_close("out", out.detach(), hi, lo)
    if grad:
        out.float().sum().backward()
        assert q.grad is not None and torch.isfinite(q.grad).all()


@pytest.mark.parametrize("how", ["position_ids", "cu_seq_lens"])
def test_attention_function_packed(how):
    dtype = DTYPES[0]
    lengths, h, h_kv, d = [5, 1, 6], 4, 2, 16
    q, k, v = _qkv(1, h, h_kv, 12, 12, d, dtype)
    cu = torch.tensor([0, 5, 6, 12], device=DEVICE)
    if how == "position_ids":
        kw = dict(position_ids=torch.tensor([[0, 1, 2, 3, 4, 7, 3, 4, 5, 6, 7, 8]], device=DEVICE))
    else:
        kw = dict(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=torch.tensor(6),
                  max_length_k=6)
    out, _ = hf.solattn_attention_forward(_Layer(), q, k, v, None, sliding_window=3, **kw)
    seg = torch.repeat_interleave(torch.arange(3, device=DEVICE), torch.tensor(lengths,
                                                                               device=DEVICE))
    i = torch.arange(12, device=DEVICE)
    allowed = (seg[:, None] == seg[None, :]) & (i[None, :] <= i[:, None]) & \
        (i[None, :] > i[:, None] - 3)
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
    hi, _ = masked_attention_ref(qt, kt, vt, allowed, upcast=True)
    lo, _ = masked_attention_ref(qt, kt, vt, allowed, upcast=False)
    assert_close("out", out, hi, lo)


def _call(mask=None, **kw):
    q, k, v = _qkv(2, 4, 2, 5, 5, 16, DTYPES[0])
    return hf.solattn_attention_forward(_Layer(), q, k, v, mask, **kw)


@pytest.mark.parametrize("kw, exc, match", [
    (dict(dropout=1.0), ValueError, "dropout_p: expected 0 <= dropout_p < 1"),
    (dict(position_bias=torch.zeros(1)), TypeError, r"honor \['position_bias'\]"),
    (dict(output_attentions=True), NotImplementedError, "output_attentions"),
    (dict(sliding_window=0), ValueError, "sliding_window: expected None or an int >= 1"),
    (dict(cu_seq_lens_q=torch.tensor([0, 5])), ValueError, "cu_seq_lens_k: expected all of"),
    (dict(mask=torch.zeros(2, 5)), TypeError, "attention_mask: expected a bool or integer"),
    (dict(mask=torch.ones(2, 3, dtype=torch.bool)), ValueError, r"attention_mask: expected shape"),
    (dict(mask=torch.tensor([[1, 1, 1, 1, 1], [1, 0, 1, 1, 1]], dtype=torch.bool),
          sliding_window=2), NotImplementedError, "one contiguous run"),
])
def test_attention_function_raises(kw, exc, match):
    if "mask" in kw:
        kw["mask"] = kw["mask"].to(DEVICE)
    with pytest.raises(exc, match=match):
        _call(**kw)


def test_fp32_needs_autocast():
    q, k, v = (t.float() for t in _qkv(2, 4, 2, 5, 5, 16, DTYPES[0]))
    with pytest.raises(TypeError, match="query: .* expected dtype torch.float16"):
        hf.solattn_attention_forward(_Layer(), q, k, v, None)
    with torch.autocast(DEVICE, dtype=DTYPES[0]):
        out, _ = hf.solattn_attention_forward(_Layer(), q, k, v, None)
    assert out.dtype == DTYPES[0]


def test_packed_check_reads_position_ids_once_per_tensor(monkeypatch):
    """Every layer of a forward gets the same position_ids: whether they restart is read from
    the device once (a synchronization), and again only for another tensor or an in-place
    change."""
    calls = []
    real = hf._packed_now
    monkeypatch.setattr(hf, "_packed_now", lambda *a: calls.append(1) or real(*a))
    pos = torch.tensor([[0, 1, 2, 0, 1, 2]], device=DEVICE)
    first = hf._packed_from_position_ids(pos, 1, 6)
    again = hf._packed_from_position_ids(pos, 1, 6)
    assert len(calls) == 1 and again is first and first[2] == 3
    plain = torch.arange(6, device=DEVICE)[None]
    assert hf._packed_from_position_ids(plain, 1, 6) is None and len(calls) == 2
    plain[0, 3] = 0  # in place: the sequence now restarts
    restarted = hf._packed_from_position_ids(plain, 1, 6)
    assert len(calls) == 3 and restarted is not None and restarted[2] == 3
