"""End to end: a ~1.1B-parameter Llama-shaped model (random weights, bf16, GQA) in transformers,
``attn_implementation="solattn"`` against ``"sdpa"``, same process, same weights.

    python3 scripts/bench_model.py [--seq 4096] [--batch 1] [--steps 5] [--new-tokens 128]
                                   [--rounds 2] [--json FILE] [--profile DIR] [--gqa-splits N]

Training step: forward + loss backward (+ ``zero_grad``) of one ``(batch, seq)`` batch, no
optimizer (its time does not depend on attention), median over ``--steps`` after two warm-up
steps. At batch 1 the step is host-bound on an H100 (BENCHMARKS.md, eleventh session: the GPU
idles between kernels while Python issues them); a larger ``--batch`` gives the GPU-bound step.
Greedy decode: ``generate`` of ``--new-tokens`` tokens after a 512-token prompt, batch 1, dynamic
cache, tokens per second (median of 3 after a warm-up), eager (no CUDA graphs); ``--new-tokens
0`` skips it. ``--gqa-splits N`` forces the Hopper backward's GQA split count (default: its rule,
``gqa_splits_of``; 1: never split) to compare the two in the training step. ``--profile``
writes, per implementation, a torch.profiler table of one training step (kernels by total GPU
time, then ops by host time) and its GPU-busy vs wall time to DIR, and skips the decode.
Shape: TinyLlama 1.1B (hidden 2048, 22 layers, 32 query heads, 4 KV heads, head dim 64, MLP
5632, vocab 32000).
``--rounds R`` measures both implementations R times, alternating which goes first, and reports
the median of the per-round ratios (this host's wall times drift by 10-30% between passes).
Token ids are drawn from 1..31999: id 0 is the pad token, which ``generate`` would read as
padding.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch


def build(seq: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22,
                      num_attention_heads=32, num_key_value_heads=4, vocab_size=32000,
                      max_position_embeddings=max(seq, 4096) + 1024, attention_dropout=0.0)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    return model


def median_ms(fn, warmup: int, reps: int) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def profile_step(step, out_dir: str, name: str) -> None:
    """One profiled training step: ``DIR/profile-<name>.txt`` gets the kernels by total GPU time
    and the step's GPU-busy time (sum of kernel times) against its wall time."""
    import os

    from torch.profiler import ProfilerActivity, profile

    os.makedirs(out_dir, exist_ok=True)
    step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t = time.perf_counter()
        step()
        torch.cuda.synchronize()
        wall_ms = (time.perf_counter() - t) * 1e3
    from torch.autograd import DeviceType

    events = prof.key_averages()
    # (op rows and their kernels' rows both carry self device time: the sum counts kernels
    # about twice; compare implementations by the attention rows)
    gpu_us = sum(e.self_device_time_total for e in events)
    # the kernels alone (device events): the time the GPU was busy during the step
    busy_us = sum(e.time_range.elapsed_us() for e in prof.events()
                  if e.device_type == DeviceType.CUDA)
    table = events.table(sort_by="self_device_time_total", row_limit=40, max_name_column_width=90)
    cpu_table = events.table(sort_by="self_cpu_time_total", row_limit=30,
                             max_name_column_width=90)
    stem = "".join(c if c.isalnum() else "_" for c in name)
    line = (f"# {name}: wall {wall_ms:.1f} ms (profiled), GPU busy {busy_us / 1e3:.1f} ms, "
            f"device time of ops + kernels {gpu_us / 1e3:.1f} ms")
    with open(os.path.join(out_dir, f"profile-{stem}.txt"), "w") as f:
        f.write(line + "\n")
        f.write(table)
        f.write("\n# by host (CPU) time\n")
        f.write(cpu_table)
    print(line, flush=True)


def main() -> int:
    import solattn.integrations.transformers as hf

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--batch", type=int, default=1, help="training step batch (decode: 1)")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--json", default=None)
    p.add_argument("--rounds", type=int, default=2,
                   help="alternating rounds (ours first, then sdpa first, ...)")
    p.add_argument("--profile", default=None, help="write per-implementation profiles here")
    p.add_argument("--gqa-splits", type=int, default=0,
                   help="force the Hopper backward's GQA split count (a divisor of the group, "
                        "8 here; 1: unsplit); 0: its default rule (kernels.hopper.backward."
                        "gqa_splits_of)")
    args = p.parse_args()
    if args.gqa_splits:
        from solattn.kernels.hopper import backward as hopper_backward

        hopper_backward.gqa_splits_of = lambda *_, **__: args.gqa_splits
    model = build(args.seq)
    n_params = sum(t.numel() for t in model.parameters())
    ids = torch.randint(1, 32000, (args.batch, args.seq), device="cuda")
    prompt = ids[:1, :512]

    def measure(impl, key):
        model.set_attn_implementation(impl)
        model.train()

        def step():
            out = model(input_ids=ids, labels=ids)
            out.loss.backward()
            model.zero_grad(set_to_none=True)

        row = dict(train_step_ms=median_ms(step, 2, args.steps))
        if args.profile:
            profile_step(step, args.profile, key)
        if args.new_tokens and not args.profile:
            model.eval()

            def decode():
                with torch.no_grad():
                    model.generate(prompt, max_new_tokens=args.new_tokens,
                                   min_new_tokens=args.new_tokens, do_sample=False,
                                   pad_token_id=0)

            row["decode_tokens_per_s"] = args.new_tokens / median_ms(decode, 1, 3) * 1e3
        dec = (f"   greedy decode {row['decode_tokens_per_s']:7.1f} tokens/s"
               if "decode_tokens_per_s" in row else "")
        print(f"{key:<22} train step (batch {args.batch}, seq {args.seq}) "
              f"{row['train_step_ms']:8.1f} ms{dec}", flush=True)
        return row

    # Round r runs ours then sdpa (r even) or sdpa then ours (r odd), so drift of the host or
    # the clocks over the run weighs on both; the ratios are taken within each round.
    rounds = []
    for r in range(args.rounds):
        order = (hf.NAME, "sdpa") if r % 2 == 0 else ("sdpa", hf.NAME)
        rounds.append({impl: measure(impl, f"{impl} (round {r + 1})") for impl in order})
    train = [x["sdpa"]["train_step_ms"] / x[hf.NAME]["train_step_ms"] for x in rounds]
    summary = (f"train step speed {statistics.median(train):.3f}x (rounds: "
               f"{', '.join(f'{t:.3f}' for t in train)})")
    if "decode_tokens_per_s" in rounds[0]["sdpa"]:
        dec = [x[hf.NAME]["decode_tokens_per_s"] / x["sdpa"]["decode_tokens_per_s"]
               for x in rounds]
        summary += (f", decode {statistics.median(dec):.3f}x (rounds: "
                    f"{', '.join(f'{t:.3f}' for t in dec)})")
    print(f"# {torch.cuda.get_device_name(0)}, torch {torch.__version__}, {n_params / 1e9:.2f}B "
          f"params, bf16, batch {args.batch}; solattn / sdpa, median over {args.rounds} rounds: "
          f"{summary}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(seq=args.seq, batch=args.batch, params=n_params, rounds=rounds), f,
                      indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
