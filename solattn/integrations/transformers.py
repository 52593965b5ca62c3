"""The "solattn" attention backend for Hugging Face transformers 5.x.

Importing this module registers two functions under the name ``"solattn"``:

* :func:`solattn_attention_forward` in ``transformers.AttentionInterface``: the attention itself,
  called by every attention layer with ``(module, query, key, value, attention_mask, **kwargs)``;
* :func:`solattn_mask` in ``transformers.masking_utils.AttentionMaskInterface``: builds, once per
  forward and mask type, the ``attention_mask`` the layers then receive.

Usage::

    import solattn.integrations.transformers  # noqa: F401  (registers "solattn")
    model = AutoModelForCausalLM.from_pretrained(name, dtype=torch.bfloat16,
                                                 attn_implementation="solattn")
    model.set_attn_implementation("solattn")   # or switch an existing model

The name has no "flash" in it on purpose: transformers routes names containing "flash" through
its own flash-attn loader and mask conventions.

How the two halves talk (the ``attention_mask`` a layer receives):

* ``None``: every key the layer is given is a real token and there is no padding: the layer
  calls :func:`solattn.flash_attn_func` on the (b, s, h, d) views, bottom-right aligned (the
  queries are the last ``q_len`` keys, which is what a KV cache gives). A decode step (one query
  row, no gradient, eager) calls :func:`solattn.flash_attn_with_kvcache` on the same views
  instead, the whole K/V being its cache: the same attention through the split-KV decode
  kernel, whose one launch and lean host path cost less than the prefill kernel's (see
  :func:`_decode_step`). Sequences packed into one
  row are found from ``position_ids`` (a position that does not follow its predecessor starts a
  new sequence) or taken from ``cu_seq_lens_q/k``, and run through
  :func:`solattn.flash_attn_varlen_func`.
* a bool tensor ``(batch, L)``: column ``j`` says whether key ``j`` of the layer's K/V is a real
  token; the queries are the last ``q_len`` of these ``L`` keys. ``L`` is shorter than the K/V a
  static cache hands over (its unfilled slots, zeros or stale values, are cut off, never attended).
  The layer unpads queries and keys and calls :func:`solattn.flash_attn_varlen_func`: left
  padding, right padding and ``q_len = 1`` decoding are all exact; a sliding window over a row
  whose real tokens are not one contiguous run cannot be expressed by compaction and raises.
* a custom 4-D mask ``(batch, 1, q_len, k_len)`` a user passed to the model (transformers hands
  it through unchanged): bool, integer or additive float, the whole mask, as the sdpa backend
  reads it; it runs as :func:`solattn.attention`'s ``attn_mask`` on the FlexAttention kernels
  (not with softcap, sinks or ``deterministic``: those raise).

What :func:`solattn_mask` accepts from ``mask_function`` (transformers' mask-pattern closures):
causal, bidirectional, sliding-window (causal or bidirectional) and packed-sequence patterns, and
their intersections. Anything else - chunked attention, bidirectional image-token blocks,
``or_mask_function``/``and_mask_function`` overlays, custom callables - raises
``NotImplementedError`` instead of being dropped. The window itself comes from the layer's
``sliding_window`` argument with the flash-attn convention transformers' models follow:
``sliding_window = w`` means ``window_size = (w - 1, 0)`` when causal (the current token and the
``w - 1`` before it) and ``(w - 1, w - 1)`` when not.

Host synchronizations: the mask function reads the padding mask once per forward (to return
``None`` for an unpadded batch); the varlen paths read sequence lengths once per layer (like
transformers' ``flash_attention_2``). ``torch.compile`` works with graph breaks there.
"""

from __future__ import annotations

import inspect
import weakref
from typing import Optional

import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

from solattn import attention, flash_attn_func, flash_attn_varlen_func, flash_attn_with_kvcache

NAME = "solattn"

# kwargs transformers passes down to every attention function that do not change the attention
# math (model outputs, loss bookkeeping, MoE/SSM-only inputs): accepted and ignored.
_IGNORED_KWARGS = frozenset({
    "num_items_in_batch", "output_hidden_states", "output_router_logits", "use_cache",
    "return_dict", "seq_idx", "cache_position",
})
_VARLEN_KWARGS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")

# transformers.masking_utils mask-pattern functions solattn can express (by qualified name).
_MU = "transformers.masking_utils"
_SUPPORTED_PATTERNS = frozenset({
    "causal_mask_function",
    "bidirectional_mask_function",
    "sliding_window_overlay.<locals>.inner_mask",
    "sliding_window_bidirectional_overlay.<locals>.inner_mask",
    "packed_sequence_mask_function.<locals>.inner_mask",  # packing is read from position_ids
    "padding_mask_function.<locals>.inner_mask",
})
_UNSUPPORTED_PATTERNS = {
    "or_masks.<locals>.or_mask": "a union of mask patterns (or_mask_function, e.g. bidirectional "
                                 "image-token blocks or a custom overlay)",
    "chunked_overlay.<locals>.inner_mask": "chunked attention (attention_chunk_size)",
    "blockwise_overlay.<locals>.inner_mask": "blockwise bidirectional blocks (block_sequence_ids)",
    "add_offsets_to_mask_function.<locals>.inner_mask": "an offset mask pattern",
}


# ----------------------------------------------------------------------------- mask function

def _check_mask_function(fn) -> None:
    """Raise ``NotImplementedError`` unless ``fn`` is an intersection of patterns solattn
    expresses (the layer's ``is_causal``/``sliding_window`` arguments carry the actual shape)."""
    module, qual = getattr(fn, "__module__", None), getattr(fn, "__qualname__", repr(fn))
    if module == _MU and qual == "and_masks.<locals>.and_mask":
        for part in inspect.getclosurevars(fn).nonlocals["mask_functions"]:
            _check_mask_function(part)
        return
    if module == _MU and qual in _SUPPORTED_PATTERNS:
        return
    what = _UNSUPPORTED_PATTERNS.get(qual, f"the custom mask function {module}.{qual}") \
        if module == _MU else f"the custom mask function {module}.{qual}"
    raise NotImplementedError(
        f"mask_function: attn_implementation={NAME!r} runs causal, bidirectional, sliding-window "
        f"and packed-sequence attention with padding; this model asked for {what}, which solattn "
        f"cannot express. Use attn_implementation='sdpa' (or 'eager') for this model.")


def solattn_mask(batch_size: int, q_length: int, kv_length: int, q_offset=0, kv_offset: int = 0,
                 mask_function=None, attention_mask: Optional[torch.Tensor] = None,
                 **kwargs) -> Optional[torch.Tensor]:
    """Mask function of the ``"solattn"`` backend (``AttentionMaskInterface``).

    Parameters
    ----------
    batch_size, q_length : the forward's batch size and number of new (query) tokens.
    kv_length, kv_offset : the layer's K/V hold ``kv_length`` slots for absolute positions
        ``kv_offset, kv_offset + 1, ...`` (from the cache's ``get_mask_sizes``).
    q_offset : int or 0-d tensor, absolute position of the first query (tokens already cached).
    mask_function : transformers' mask pattern; checked by :func:`_check_mask_function`.
    attention_mask : optional 2-D (batch, n) padding mask, True/1 = real token. Column ``p`` is
        absolute position ``p`` (transformers' convention), except a mask this function returned
        earlier (``n == q_offset + q_length - kv_offset`` with ``kv_offset > 0``), which is
        already relative to ``kv_offset`` and is returned as is (``generate`` builds masks ahead
        of the forward, and some models feed them through their mask function again).
    **kwargs : the other arguments transformers passes (``dtype``, ``config``, ``device``,
        ``allow_is_causal_skip``, ...), not needed here.

    Returns
    -------
    None when every key slot up to the last query is a real token; else a bool tensor
    ``(batch_size, L)``, ``L = q_offset + q_length - kv_offset <= kv_length``: whether key ``j``
    of the layer's K/V is a real token. Slots past ``L`` (a static cache's unfilled tail) are cut.
    """
    if mask_function is not None:
        _check_mask_function(mask_function)
    q_end = int(q_offset) + q_length  # one past the last query's absolute position
    n_keys = q_end - kv_offset       # key slots that hold tokens: [kv_offset, q_end)
    if not 0 < n_keys <= kv_length or q_length > n_keys:
        raise ValueError(f"kv_length: expected the K/V slots [kv_offset, kv_offset + kv_length) = "
                         f"[{kv_offset}, {kv_offset + kv_length}) to hold the queries' positions "
                         f"[{q_end - q_length}, {q_end}), got q_offset={int(q_offset)}, "
                         f"q_length={q_length}")
    if attention_mask is None:
        if n_keys == kv_length:
            return None
        return torch.ones(batch_size, n_keys, dtype=torch.bool, device=kwargs.get("device", "cpu"))
    if attention_mask.dim() != 2 or attention_mask.shape[0] != batch_size:
        raise ValueError(f"attention_mask: expected a 2-D padding mask of shape ({batch_size}, "
                         f"seqlen), got shape {tuple(attention_mask.shape)}")
    mask = attention_mask.to(torch.bool)
    n = mask.shape[1]
    if kv_offset > 0 and n == n_keys:
        valid = mask  # already relative to kv_offset (built by this function)
    else:
        if n < q_end:  # absent columns are padding, as in transformers' sdpa_mask
            mask = torch.nn.functional.pad(mask, (0, q_end - n), value=False)
        valid = mask[:, kv_offset:q_end]
    if n_keys == kv_length and not torch.compiler.is_compiling() and bool(valid.all()):
        return None
    return valid


# ----------------------------------------------------------------------------- attention

def _window(sliding_window, causal: bool) -> tuple[int, int]:
    if sliding_window is None:
        return (-1, -1)
    if isinstance(sliding_window, bool) or not isinstance(sliding_window, int) \
            or sliding_window < 1:
        raise ValueError(f"sliding_window: expected None or an int >= 1 (the number of keys a "
                         f"query sees, itself included), got {sliding_window!r}")
    w = sliding_window - 1
    return (w, 0) if causal else (w, w)


def _check_kwargs(kwargs: dict) -> None:
    if kwargs.get("output_attentions"):
        raise NotImplementedError(
            f"output_attentions: attn_implementation={NAME!r} never materializes attention "
            f"weights; expected output_attentions=False, got True (use attn_implementation="
            f"'eager' to get them)")
    unknown = sorted(k for k, v in kwargs.items()
                     if k not in _IGNORED_KWARGS and k not in _VARLEN_KWARGS
                     and k != "output_attentions" and v is not None)
    if unknown:
        raise TypeError(f"attention kwargs: attn_implementation={NAME!r} does not know how to "
                        f"honor {unknown}; expected only dropout, scaling, is_causal, "
                        f"sliding_window, softcap, s_aux, position_ids, deterministic, "
                        f"{', '.join(_VARLEN_KWARGS)}")


# The last position_ids tensor seen and its answer: (weakref, its _version, batch, answer). Every
# attention layer of a model's forward gets the same position_ids tensor; reading whether it
# restarts needs the values on the host (a device synchronization, which stalls the host's
# launches behind the GPU's queue): once per forward, not once per layer.
_PACKED_MEMO: list = [None, -1, -1, None]


def _packed_from_position_ids(position_ids, batch: int, seqlen: int):
    """``(cu_q, cu_k, max_q, max_k)`` if ``position_ids`` (batch or 1, seqlen) restart inside a
    row (packed sequences), else None. Every row starts a sequence. The answer for the same
    tensor object, unmodified (``_version``), is reused."""
    if (not isinstance(position_ids, torch.Tensor) or position_ids.dim() != 2
            or position_ids.shape[1] != seqlen or position_ids.shape[0] not in (1, batch)):
        return None
    if torch.compiler.is_compiling():
        return _packed_now(position_ids, batch, seqlen)
    ref, version, memo_batch, answer = _PACKED_MEMO
    if (ref is not None and ref() is position_ids and version == position_ids._version
            and memo_batch == batch):
        return answer
    answer = _packed_now(position_ids, batch, seqlen)
    _PACKED_MEMO[:] = [weakref.ref(position_ids), position_ids._version, batch, answer]
    return answer


def _packed_now(position_ids, batch: int, seqlen: int):
    """:func:`_packed_from_position_ids` without the memo."""
    pos = position_ids.expand(batch, seqlen)
    starts = torch.ones(batch, seqlen, dtype=torch.bool, device=pos.device)
    starts[:, 1:] = (pos[:, 1:] - pos[:, :-1]) != 1
    if seqlen < 2 or not bool(starts[:, 1:].any()):
        return None
    idx = starts.flatten().nonzero().flatten().to(torch.int32)
    cu = torch.cat([idx, idx.new_tensor([batch * seqlen])])
    longest = int((cu[1:] - cu[:-1]).max())
    return cu, cu, longest, longest


def _varlen_kwargs(kwargs: dict, device):
    """``(cu_q, cu_k, max_q, max_k)`` from transformers' ``cu_seq_lens_*``/``max_length_*``, or
    None if none is given."""
    given = {k: kwargs.get(k) for k in _VARLEN_KWARGS}
    if all(v is None for v in given.values()):
        return None
    missing = [k for k, v in given.items() if v is None]
    if missing:
        raise ValueError(f"{missing[0]}: expected all of {list(_VARLEN_KWARGS)} together for "
                         f"packed sequences, got None for {missing}")
    cu_q, cu_k = (given[k].to(device=device, dtype=torch.int32) for k in _VARLEN_KWARGS[:2])
    return cu_q, cu_k, int(given["max_length_q"]), int(given["max_length_k"])


def _zero_rows_past(out: torch.Tensor, total) -> torch.Tensor:
    """Rows ``>= total`` of a packed (t, h, d) output are not written by the varlen kernel."""
    keep = torch.arange(out.shape[0], device=out.device) < total
    return torch.where(keep[:, None, None], out, out.new_zeros(()))


def _unpad_stats(m: torch.Tensor, mq: torch.Tensor, check_runs: bool):
    """One host read: longest key / query sequence, and whether some row's real tokens are not
    one contiguous run (only computed for windows)."""
    n_k, n_q = m.sum(1), mq.sum(1)
    stats = [n_k.max(), n_q.max()]
    if check_runs:
        L = m.shape[1]
        first = m.int().argmax(1)
        last = L - 1 - m.flip(1).int().argmax(1)
        stats.append(((n_k > 0) & (last - first + 1 != n_k)).any().to(n_k.dtype))
    vals = torch.stack(stats).tolist()
    return int(vals[0]), int(vals[1]), bool(vals[2]) if check_runs else False


def _as_key_mask(attention_mask, b: int, q_len: int, k_len: int) -> torch.Tensor:
    if attention_mask.dim() != 2:
        raise NotImplementedError(
            f"attention_mask: attn_implementation={NAME!r} takes None, a 2-D (batch, seqlen) "
            f"padding mask (as built by its mask function) or a 4-D (batch, 1, q_len, k_len) "
            f"mask; got a {attention_mask.dim()}-D tensor of shape "
            f"{tuple(attention_mask.shape)}")
    L = attention_mask.shape[1]
    if attention_mask.shape[0] != b or not q_len <= L <= k_len:
        raise ValueError(f"attention_mask: expected shape ({b}, L) with {q_len} (query length) "
                         f"<= L <= {k_len} (key length), got {tuple(attention_mask.shape)}")
    if attention_mask.dtype == torch.bool:
        return attention_mask
    if attention_mask.dtype.is_floating_point or attention_mask.is_complex():
        raise TypeError(f"attention_mask: expected a bool or integer 0/1 padding mask, got dtype "
                        f"{attention_mask.dtype} (additive float masks are not supported)")
    return attention_mask != 0


def solattn_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                              value: torch.Tensor, attention_mask: Optional[torch.Tensor],
                              dropout: float = 0.0, scaling: Optional[float] = None,
                              sliding_window: Optional[int] = None,
                              softcap: Optional[float] = None, is_causal: Optional[bool] = None,
                              s_aux: Optional[torch.Tensor] = None, deterministic: bool = False,
                              position_ids: Optional[torch.Tensor] = None,
                              **kwargs) -> tuple[torch.Tensor, None]:
    """Attention function of the ``"solattn"`` backend (``AttentionInterface``).

    Parameters
    ----------
    module : the calling attention layer; ``module.is_causal`` is used when ``is_causal`` is None.
    query : (batch, nheads, q_len, headdim), fp16 or bf16 (fp32 only under autocast, cast to the
        autocast dtype).
    key, value : (batch, nheads_kv, k_len, headdim[_v]), GQA/MQA heads *not* repeated.
    attention_mask : None or a 2-D (batch, L) key mask from :func:`solattn_mask` (see the module
        docstring); integer 0/1 masks are accepted too. A custom 4-D mask (bool, integer or
        additive float) runs as SDPA's ``attn_mask`` (:func:`_attend_dense_mask`).
    dropout : attention dropout probability in [0, 1): transformers passes the config's
        ``attention_dropout`` in training mode and 0.0 in ``eval()``. Applied by solattn's
        kernels (``dropout_p`` of :func:`solattn.flash_attn_func`: a Philox mask from torch's
        generator, reproducible under ``torch.manual_seed``; not the mask eager/sdpa would
        draw).
    scaling : softmax scale, default ``headdim ** -0.5``.
    sliding_window : transformers' window size ``w`` (the query and the ``w - 1`` keys before it);
        ``window_size = (w - 1, 0)`` causal, ``(w - 1, w - 1)`` bidirectional.
    softcap : logit soft-capping (Gemma 2), None or 0 = off.
    is_causal : causal (bottom-right aligned: the queries are the last keys) or bidirectional.
    s_aux : optional (nheads,) attention-sink logits (gpt-oss), applied with
        :func:`solattn.sinks.apply_sinks`; gradients reach them.
    deterministic : bitwise-reproducible backward.
    position_ids : (batch or 1, q_len); restarts inside a row mark packed sequences (used only
        when there is no padding mask and ``q_len == k_len``).
    **kwargs : ``cu_seq_lens_q``, ``cu_seq_lens_k``, ``max_length_q``, ``max_length_k`` (packed
        sequences, all four together); ``output_attentions=True`` raises; transformers' output
        and bookkeeping flags are ignored; any other non-None keyword raises ``TypeError``.

    Returns
    -------
    (out, None): out (batch, q_len, nheads, headdim_v) in query's dtype; padded query rows are 0.
    """
    _check_kwargs(kwargs)
    if query.dtype == torch.float32 and torch.is_autocast_enabled(query.device.type):
        dt = torch.get_autocast_dtype(query.device.type)
        query, key, value = query.to(dt), key.to(dt), value.to(dt)
    if query.dtype not in (torch.float16, torch.bfloat16):
        raise TypeError(f"query: attn_implementation={NAME!r} expected dtype torch.float16 or "
                        f"torch.bfloat16, got {query.dtype} (load the model with dtype="
                        f"torch.bfloat16, or run under torch.autocast)")
    causal = bool(getattr(module, "is_causal", True) if is_causal is None else is_causal)
    if s_aux is not None and s_aux.dtype not in (torch.float32, query.dtype):
        s_aux = s_aux.float()
    common = dict(dropout_p=float(dropout or 0.0), softmax_scale=scaling, causal=causal,
                  window_size=_window(sliding_window, causal), softcap=float(softcap or 0.0),
                  deterministic=bool(deterministic), sinks=s_aux)

    b, _, q_len, _ = query.shape
    k_len = key.shape[2]
    q, k, v = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)  # (b, s, h, d)
    varlen = _varlen_kwargs(kwargs, query.device)
    if attention_mask is not None:
        if varlen is not None:
            raise ValueError("cu_seq_lens_q: expected packed sequences (cu_seq_lens_*) or a "
                             "padding attention_mask, not both; got both")
        if attention_mask.dim() == 4:
            return _attend_dense_mask(query, key, value, attention_mask, common), None
        m = _as_key_mask(attention_mask, b, q_len, k_len)
        return _attend_padded(q, k, v, m, common, sliding_window), None
    if varlen is None and q_len == k_len:
        varlen = _packed_from_position_ids(position_ids, b, q_len)
    if varlen is not None:
        return _attend_packed(q, k, v, varlen, common), None
    if q_len == 1 and _decode_step(query, key, value, s_aux, common):
        return flash_attn_with_kvcache(q, k, v, softmax_scale=scaling, causal=causal,
                                       window_size=common["window_size"],
                                       softcap=common["softcap"], sinks=s_aux), None
    return flash_attn_func(q, k, v, **common), None


def _decode_step(query, key, value, s_aux, common) -> bool:
    """Whether an unmasked one-row call runs as :func:`solattn.flash_attn_with_kvcache` over
    the whole K/V (no ``cache_seqlens``: every key is used, the query aligned to the last, as
    :func:`solattn.flash_attn_func` aligns it): eager, no dropout, no gradient wanted (that
    function has no backward). ``flash_attn_func`` reaches the same kernels for such calls
    (:func:`solattn.configs.small_q_decode`) through its validation and autograd layers; this
    call skips them, its validation cached per shape. A model's decode step hands every layer a
    new, longer K/V; H100, TinyLlama's attention (Hq32 Hkv4 d64, ~540 keys), 22 layers of new
    tensors a step: 27-29 us of host time a call, sdpa's backend 28-30 us
    (``scripts/decode_host_model.py``, 2026-11-26)."""
    if torch.compiler.is_compiling() or common["dropout_p"] > 0:
        return False
    return not (torch.is_grad_enabled() and (
        query.requires_grad or key.requires_grad or value.requires_grad
        or (s_aux is not None and s_aux.requires_grad)))


def _attend_padded(q, k, v, m, common, sliding_window):
    """``m (b, L)``: key ``j < L`` is real; queries are the last ``q_len`` of the ``L`` keys.
    Unpad both, one varlen call, scatter back (padded query rows 0)."""
    b, q_len, h, _ = q.shape
    L, h_kv = m.shape[1], k.shape[2]
    mq = m[:, L - q_len:]
    max_k, max_q, gaps = _unpad_stats(m, mq, check_runs=common["window_size"] != (-1, -1))
    if gaps:
        raise NotImplementedError(
            f"attention_mask: with sliding_window={sliding_window} solattn needs each row's real "
            f"tokens to be one contiguous run (left or right padding); got a mask with padding "
            f"between tokens. Use attn_implementation='sdpa' for this input")
    idx_k = m.flatten().nonzero().flatten()
    idx_q = mq.flatten().nonzero().flatten()
    cu_k, cu_q = (torch.nn.functional.pad(t.sum(1, dtype=torch.int32).cumsum(0, dtype=torch.int32),
                                          (1, 0)) for t in (m, mq))
    qu = q.reshape(b * q_len, h, -1).index_select(0, idx_q)
    ku = k[:, :L].reshape(b * L, h_kv, -1).index_select(0, idx_k)
    vu = v[:, :L].reshape(b * L, h_kv, -1).index_select(0, idx_k)
    out = flash_attn_varlen_func(qu, ku, vu, cu_q, cu_k, max(max_q, 1), max(max_k, 1), **common)
    full = out.new_zeros(b * q_len, *out.shape[1:])
    return full.index_copy(0, idx_q, out).view(b, q_len, *out.shape[1:])


def _attend_dense_mask(query, key, value, mask, common):
    """A custom 4-D mask ``(batch or 1, heads or 1, q_len, k_len)``, which transformers passes
    through unchanged: bool / integer (nonzero: attend) or additive float, the whole mask
    (causality and any window included, as the sdpa backend reads it, so ``is_causal`` and
    ``sliding_window`` are not applied on top), on :func:`solattn.attention`'s ``attn_mask``
    (FlexAttention kernels). Softcap, sinks and ``deterministic`` do not combine with it."""
    for name, unsupported in (("softcap", common["softcap"]),
                              ("s_aux", common["sinks"] is not None),
                              ("deterministic", common["deterministic"])):
        if unsupported:
            raise NotImplementedError(
                f"attention_mask: attn_implementation={NAME!r} runs a 4-D mask on its "
                f"FlexAttention kernels, which do not take {name}; use attn_implementation="
                f"'sdpa' (or 'eager') for this model with a custom mask")
    if mask.dtype.is_floating_point:
        mask = mask.to(query.dtype)
    elif mask.dtype != torch.bool:
        mask = mask != 0
    out = attention(query, key, value, attn_mask=mask, dropout_p=common["dropout_p"],
                    scale=common["softmax_scale"], enable_gqa=True)
    return out.transpose(1, 2)


def _attend_packed(q, k, v, varlen, common):
    """Rows of the flattened (b * s) tokens split by ``cu_seqlens``: one varlen call."""
    cu_q, cu_k, max_q, max_k = varlen
    qf, kf, vf = (t.reshape(-1, *t.shape[2:]) for t in (q, k, v))
    out = flash_attn_varlen_func(qf, kf, vf, cu_q, cu_k, max_q, max_k, **common)
    return _zero_rows_past(out, cu_q[-1]).view(*q.shape[:3], -1)


def register() -> None:
    """Register (again) ``"solattn"`` with transformers' attention and mask interfaces. Called on
    import of this module; idempotent."""
    AttentionInterface.register(NAME, solattn_attention_forward)
    AttentionMaskInterface.register(NAME, solattn_mask)


register()
