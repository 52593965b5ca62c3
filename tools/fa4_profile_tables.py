"""Side-by-side tables from the Nsight Compute raw pages that tools/profile_fa4.sh writes.

usage: python tools/fa4_profile_tables.py OURS_RAW.csv FA4_RAW.csv [OURS_SRC.csv FA4_SRC.csv]

The raw pages (`ncu --import R --page raw --csv --print-units base`) hold one row per profiled
kernel, in the order of `tools/profile_fa4.py profile`: fwd_d128, fwd_d64, then per backward
case the preprocess, main and postprocess (ours: dQ convert) kernels. With the source pages
(`--page source --csv --print-source sass`) it also counts the SASS structure of each main
kernel and the sampled stall reasons per instruction class.
"""
import csv
import re
import sys
from collections import Counter

CASES = ["fwd_d128", "fwd_d64", "bwd_d128", "bwd_d128_causal", "bwd_d64_causal"]

# (label, metric, scale) — printed as value * scale
METRICS = [
    ("duration (us)", "gpu__time_duration.sum", 1e-3),
    ("SM clock (GHz)", "sm__cycles_elapsed.avg.per_second", 1e-9),
    ("grid", "launch__grid_size", 1),
    ("threads/CTA", "launch__block_size", 1),
    ("regs/thread at launch", "launch__registers_per_thread", 1),
    ("smem/CTA (KiB)", "launch__shared_mem_per_block", 1 / 1024),
    ("tensor pipe active % (of elapsed)",
     "sm__pipe_tensor_type_hmma_hgmma_qgmma_imma_igmma_bmma_bgmma_cycles_active.avg"
     ".pct_of_peak_sustained_elapsed", 1),
    ("tensor pipe active % (of active)", "sm__pipe_tensor_cycles_active.avg"
     ".pct_of_peak_sustained_active", 1),
    ("SM throughput %", "sm__throughput.avg.pct_of_peak_sustained_elapsed", 1),
    ("issue slots busy % (smsp)", "smsp__issue_active.avg.pct_of_peak_sustained_active", 1),
    ("instructions executed (M)", "smsp__inst_executed.sum", 1e-6),
    ("warps active / scheduler", "smsp__warps_active.avg.per_cycle_active", 1),
    ("warps eligible / scheduler", "smsp__warps_eligible.avg.per_cycle_active", 1),
    ("FMA pipe %", "sm__inst_executed_pipe_fma.avg.pct_of_peak_sustained_active", 1),
    ("ALU pipe %", "sm__inst_executed_pipe_alu.avg.pct_of_peak_sustained_active", 1),
    ("XU (MUFU) pipe %", "sm__inst_executed_pipe_xu.avg.pct_of_peak_sustained_active", 1),
    ("uniform pipe %", "sm__inst_executed_pipe_uniform.avg.pct_of_peak_sustained_active", 1),
    ("DRAM read (MB)", "dram__bytes_read.sum", 1e-6),
    ("DRAM write (MB)", "dram__bytes_write.sum", 1e-6),
    ("L2 hit %", "lts__t_sector_hit_rate.pct", 1),
    ("smem ld wavefronts (M)", "l1tex__data_pipe_lsu_wavefronts_mem_shared_op_ld.sum", 1e-6),
    ("smem st wavefronts (M)", "l1tex__data_pipe_lsu_wavefronts_mem_shared_op_st.sum", 1e-6),
    ("smem ld bank conflicts (M)", "l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_ld.sum",
     1e-6),
    ("smem st bank conflicts (M)", "l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_st.sum",
     1e-6),
    ("global red/atom wavefronts (M)",
     "l1tex__t_output_wavefronts_pipe_lsu_mem_global_op_red.sum", 1e-6),
    ("TMA reduce (dshared) sectors (M)",
     "l1tex__m_xbar2l1tex_read_sectors_mem_dshared_op_tma_red.sum", 1e-6),
    ("local ld/st (spill) inst", "smsp__sass_inst_executed_op_local_ld.sum", 1),
]
STALL = re.compile(r"^smsp__average_warps_issue_stalled_(\w+)_per_issue_active\.ratio$")


def load_raw(path):
    rows = list(csv.reader(open(path)))
    hdr = rows[0]
    out = []
    for r in rows[2:]:  # row 1 holds the units
        if len(r) == len(hdr) and r[0].strip('"').isdigit():
            out.append(dict(zip(hdr, r)))
    return out


def num(x):
    try:
        return float(str(x).replace(",", ""))
    except ValueError:
        return float("nan")


def mains(raw):
    """case -> list of the case's kernels (main kernel first)."""
    by = {"fwd_d128": [raw[0]], "fwd_d64": [raw[1]]}
    for i, c in enumerate(CASES[2:]):
        pre, main, post = raw[2 + 3 * i: 5 + 3 * i]
        by[c] = [main, pre, post]
    return by


def fmt(v):
    if v != v:
        return "-"
    if abs(v) >= 100:
        return f"{v:,.0f}"
    if abs(v) >= 10:
        return f"{v:.1f}"
    return f"{v:.2f}"


def tables(ours, fa4):
    o, f = mains(ours), mains(fa4)
    for c in CASES:
        om, fm = o[c][0], f[c][0]
        print(f"\n### {c}\n\n| metric (main kernel) | solattn | FA4 |\n|---|---|---|")
        if len(o[c]) > 1:
            ot = sum(num(k["gpu__time_duration.sum"]) for k in o[c]) * 1e-3
            ft = sum(num(k["gpu__time_duration.sum"]) for k in f[c]) * 1e-3
            print(f"| all three kernels (us) | {fmt(ot)} | {fmt(ft)} |")
        for label, m, s in METRICS:
            print(f"| {label} | {fmt(num(om.get(m)) * s)} | {fmt(num(fm.get(m)) * s)} |")
        stalls = []
        for m in om:
            g = STALL.match(m)
            if g:
                stalls.append((g.group(1), num(om[m]), num(fm.get(m))))
        stalls.sort(key=lambda t: -(t[1] + t[2]))
        for name, a, b in stalls:
            if a + b >= 0.05:
                print(f"| stall {name} (warps per issue) | {fmt(a)} | {fmt(b)} |")


def load_source(path):
    """The source page export -> [(kernel name, [row dict, ...]), ...] in profile order."""
    kernels, hdr = [], None
    for r in csv.reader(open(path)):
        if not r:
            continue
        if r[0] == "Kernel Name":
            kernels.append((r[1], []))
        elif r[0] == "Address":
            hdr = r
        elif kernels and hdr:
            kernels[-1][1].append(dict(zip(hdr, r)))
    return kernels


SAMPLES = "Warp Stall Sampling (All Samples)"
EXECUTED = "Instructions Executed"
MARK = re.compile(r"^(HGMMA|WARPGROUP|BAR|SYNCS\.ARRIVE|MUFU|UBLKRED|REDG|RED\.)")


def opcode(sass):
    return re.sub(r"^@!?U?P\w+\s+", "", sass.strip()).split(" ")[0]


def sass_report(label, rows):
    """HGMMA shapes, the main loop's order of wgmma issue/wait, barriers and MUFU, and where
    the stall samples land (by opcode class and the top instructions)."""
    total = sum(num(r[SAMPLES]) for r in rows) or 1.0
    shapes = Counter()
    for r in rows:
        m = re.search(r"HGMMA\.(\d+x\d+x\d+)\S* R\d+, (R\d+, )?gdesc", r["Source"])
        if m:
            shapes[m.group(1) + (" RS" if m.group(2) else " SS")] += num(r[EXECUTED])
    print(f"\n## {label}\nHGMMA executed by shape: "
          + ", ".join(f"{k} {v / 1e6:.2f}M" for k, v in shapes.most_common()))
    # the main loop: the instructions executed as often as the most frequent HGMMA
    hg = Counter(num(r[EXECUTED]) for r in rows if "HGMMA" in r["Source"])
    trip = max(hg, key=lambda c: (hg[c], c))
    seq = []
    for r in rows:
        if abs(num(r[EXECUTED]) - trip) > 0.02 * trip:
            continue
        o = opcode(r["Source"])
        if not MARK.match(o):
            continue
        tok = o.split(".")[0] if o.startswith(("HGMMA", "MUFU")) else \
            " ".join(re.sub(r"^@!?U?P\w+\s+", "", r["Source"].strip()).split()[:3])
        if seq and seq[-1][0] == tok:
            seq[-1][1] += 1
        else:
            seq.append([tok, 1])
    print(f"main loop (instructions executed {trip:,.0f} times each), in address order:")
    print("  " + " | ".join(f"{t} x{c}" if c > 1 else t for t, c in seq))
    by = {}
    for r in rows:
        o = opcode(r["Source"]).split(".")[0]
        c = by.setdefault(o, Counter())
        c["samples"] += num(r[SAMPLES])
        c["executed"] += num(r[EXECUTED])
        for k, v in r.items():
            if k.startswith("stall_") and "Not Issued" not in k:
                c[k[6:]] += num(v)
    print("stall samples by opcode (% of the kernel's samples; executed warp-instructions):")
    for o, c in sorted(by.items(), key=lambda t: -t[1]["samples"])[:12]:
        why = ", ".join(f"{k} {v / total * 100:.1f}" for k, v in c.most_common()
                        if k not in ("samples", "executed") and v / total > 0.005)
        print(f"  {o:10s} {c['samples'] / total * 100:5.1f}%  {c['executed'] / 1e6:8.2f}M  [{why}]")
    print("top instructions by samples:")
    for r in sorted(rows, key=lambda r: -num(r[SAMPLES]))[:12]:
        why = ", ".join(f"{k[6:]} {num(v):.0f}" for k, v in r.items() if k.startswith("stall_")
                        and "Not Issued" not in k and num(v) > 0.1 * num(r[SAMPLES]))
        print(f"  {num(r[SAMPLES]) / total * 100:5.1f}%  exec {num(r[EXECUTED]):>9,.0f}  "
              f"{r['Source'].strip()[:64]}  [{why}]")


def sass_reports(ours_src, fa4_src):
    for lib, path in (("solattn", ours_src), ("FA4", fa4_src)):
        ks = load_source(path)
        main = [0, 1, 3, 6, 9]  # the main kernel of each case in profile order
        for case, i in zip(CASES, main):
            sass_report(f"{case} {lib}", ks[i][1])


if __name__ == "__main__":
    tables(load_raw(sys.argv[1]), load_raw(sys.argv[2]))
    if len(sys.argv) > 4:
        sass_reports(sys.argv[3], sys.argv[4])
