"""``model``: end to end, a ~1.1B-parameter Llama-shaped transformers model (random weights,
bf16, GQA 32/4, d=64) with ``attn_implementation="solattn"`` against ``"sdpa"``, same process,
same weights: a training step (forward + loss backward, no optimizer) of one 4096-token
sequence (host-bound on an H100), of 4 of them and of one 16k-token sequence (not with --quick),
and greedy decoding (128 new tokens after a 512-token prompt, tokens/s); then (not with
--quick) the training step of a 1.3B d=128 Llama (Sheared-LLaMA-1.3B's shape: 24 layers, 16
heads of 128, no GQA) on one 16k-token sequence, issue 38's end-to-end target. Each call is
timed whole (one synchronized wall-clock call per round). A training row's label names the
SDPA backend torch picks for the model's calls (:func:`sdpa_backends`)."""

from __future__ import annotations

import torch

from ..peers import PeerUnavailable
from ..suite import Row, Suite

IMPLS = {"solattn": "solattn", "sdpa": "sdpa"}


def _model(ctx, seq: int, size: str = "1.1B"):
    try:
        from transformers import LlamaConfig, LlamaForCausalLM
    except ImportError as exc:
        raise PeerUnavailable(f"needs transformers ({exc})") from exc
    import solattn.integrations.transformers  # noqa: F401  (registers "solattn")

    if ctx.cpu:
        cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
                          max_position_embeddings=256, attention_dropout=0.0)
    elif size == "1.3B":
        cfg = LlamaConfig(hidden_size=2048, intermediate_size=5504, num_hidden_layers=24,
                          num_attention_heads=16, num_key_value_heads=16, vocab_size=32000,
                          max_position_embeddings=seq + 1024, attention_dropout=0.0)
    else:
        cfg = LlamaConfig(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22,
                          num_attention_heads=32, num_key_value_heads=4, vocab_size=32000,
                          max_position_embeddings=4 * seq + 1024, attention_dropout=0.0)
    torch.manual_seed(0)
    with torch.device(ctx.device):
        return LlamaForCausalLM(cfg).to(ctx.dtype), cfg.vocab_size


def _rows(ctx):
    seq, new, prompt_len = (32, 4, 8) if ctx.cpu else (4096, 128, 512)
    try:
        model, vocab = _model(ctx, seq)
    except PeerUnavailable as exc:
        yield Row("model", {n: _unavailable(str(exc)) for n in IMPLS})
        return
    g = torch.Generator(device=ctx.device).manual_seed(0)
    ids = torch.randint(1, vocab, (1, seq), device=ctx.device, generator=g)
    prompt = ids[:, :prompt_len]

    def step(impl, ids=ids):
        return _train_step(model, impl, ids)

    def reference():
        model.set_attn_implementation("eager")
        with torch.no_grad():
            return model(input_ids=ids, labels=ids).loss.double()

    yield Row(f"train step B1 L{seq} (sdpa: {sdpa_backends(model, ids)})",
              {n: step(i) for n, i in IMPLS.items()}, unit="ms", section="fwdbwd",
              timer="wall", reference=reference)
    # the GPU-bound steps (batch 1 at 4k tokens is host-bound on an H100)
    for b, n in ([] if ctx.cpu or ctx.quick else [(4, seq), (1, 4 * seq)]):
        more = torch.randint(1, vocab, (b, n), device=ctx.device, generator=g)
        yield Row(f"train step B{b} L{n} (sdpa: {sdpa_backends(model, more)})",
                  {k: step(i, more) for k, i in IMPLS.items()}, unit="ms", section="fwdbwd",
                  timer="wall")

    def decode(impl):
        def build():
            def run():
                model.set_attn_implementation(impl)
                model.eval()
                with torch.no_grad():
                    return model.generate(prompt, max_new_tokens=new, min_new_tokens=new,
                                          do_sample=False, pad_token_id=0)
            return run
        return build

    yield Row(f"greedy decode {new} tokens after {prompt_len}", {n: decode(i)
                                                                for n, i in IMPLS.items()},
              work=new, unit="tok/s", section="decode", timer="wall")
    if ctx.cpu or ctx.quick:
        return
    big, _ = _model(ctx, 4 * seq, "1.3B")
    ids = torch.randint(1, vocab, (1, 4 * seq), device=ctx.device, generator=g)
    yield Row(f"1.3B d128 train step B1 L{4 * seq} (sdpa: {sdpa_backends(big, ids)})",
              {k: _train_step(big, i, ids) for k, i in IMPLS.items()}, unit="ms",
              section="fwdbwd", timer="wall")


def _train_step(model, impl, ids):
    """The builder of one training step of ``model`` on ``ids`` with attention ``impl``
    (forward, loss, backward; gradients dropped)."""
    def build():
        def run():
            model.set_attn_implementation(impl)
            model.train()
            out = model(input_ids=ids, labels=ids)
            out.loss.backward()
            model.zero_grad(set_to_none=True)
            return out.loss.detach()
        return run
    return build


def sdpa_backends(model, ids) -> str:
    """The kernels ``attn_implementation="sdpa"`` runs in a training step of ``model`` on
    ``ids``: torch's own dispatch choice (``torch._fused_sdp_choice``, named as in
    :class:`torch.nn.attention.SDPBackend`) for the arguments of each
    ``scaled_dot_product_attention`` call of one step, joined with "/" when they differ."""
    from torch.nn.attention import SDPBackend

    names = {int(getattr(SDPBackend, n)): n for n in dir(SDPBackend) if n.isupper()}
    seen = set()
    original = torch.nn.functional.scaled_dot_product_attention

    def spy(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
            enable_gqa=False):
        choice = torch._fused_sdp_choice(query, key, value, attn_mask, dropout_p, is_causal,
                                         scale=scale, enable_gqa=enable_gqa)
        seen.add(names.get(int(choice), str(choice)))
        return original(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p,
                        is_causal=is_causal, scale=scale, enable_gqa=enable_gqa)

    torch.nn.functional.scaled_dot_product_attention = spy
    try:
        _train_step(model, "sdpa", ids)()()
    finally:
        torch.nn.functional.scaled_dot_product_attention = original
    return "/".join(sorted(seen)) or "no call"


def _unavailable(why):
    def build():
        raise PeerUnavailable(why)
    return build


MODEL = Suite("model", "a ~1.1B Llama-shaped transformers model, attn_implementation solattn "
              "against sdpa: training step (ms) and greedy decoding (tokens/s); a 1.3B d=128 "
              "one's training step at 16k tokens",
              tuple(IMPLS), _rows, baseline="sdpa")
