"""Traffic model of one attention layer's GPU work in a decode step (issue 58, deliverable 2):
HBM bytes, tensor-core FLOPs and launches of every kernel, from shapes, turned into time by a
roofline; no GPU needed (docs/cuda.md, "Split-KV decode: the design on paper").

Three sides, per case (decode, a step where every row compacts, prefill):

- ``vllm``: vLLM 0.32's Triton ``unified_attention``: the 2D kernel, or with few decode rows
  (rows <= 128 // kv_heads) the 3D split-KV kernel (16 segments) and its ``reduce_segments``.
- ``today``: H2O as ``worker/cuda/ops.py`` and ``worker/step.py`` launch it: the fused attention
  (``kernels.h2o_attention``: logits scratch written and read back, scores read and written),
  for prefill pass 2 (``accumulate_prefill_scores_from_lse``), and per due group the torch ops
  of ``select_keep`` and the attention mass, then ``kernels.compact_rows``.
- ``design``: split-KV fused attention that stores logits and per-split (max, sum), a reduce
  that finalises the output and the scores, and one select+compact launch over every row
  (rows not due read their flag and stop). ``fill`` compaction moves the kept tokens at slots
  >= target into the evicted slots below it (at most kv_len - target tokens, a position tag
  per slot keeps the policy's order); ``ordered`` (``design-ordered``) keeps slot order, as
  ``compact_rows`` does, and moves every kept token after the first hole.

Time of one launch: max(host, gpu), gpu = kernels * launch_us + max(bytes / HBM bandwidth,
FLOPs / tensor peak) / fill, fill = min(1, programs / SMs). Host time is zero when the launch
is replayed from a CUDA graph (``graph`` mode, the design's point) and the Python dispatch cost
in eager mode. The ratio reported is the issue's: (H2O's time - vLLM's attention time) / vLLM's.

    python benchmarks/traffic_model.py                          # H200, the H200 run's shapes
    python benchmarks/traffic_model.py --device h100 --rows 32 --kv-len 4096
"""

import argparse
import dataclasses
import json
import math
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MEASURED = ROOT / "benchmarks/results/2026-12-04-h200-gpu-2/call2/cuda_step_timing.json"


@dataclass(frozen=True)
class Device:
    name: str
    hbm_bytes_per_s: float
    tensor_flops: float    # dense bf16/fp16 tensor-core peak
    sms: int
    l2_bytes_per_s: float  # rate of tile loads that re-read L2 (not on a datasheet: see DEVICES)
    launch_us: float       # GPU time per kernel beyond its traffic: launch, ramp-up, tail
    host_torch_us: float   # eager: one torch op's Python + dispatcher + launch
    host_triton_us: float  # eager: a Triton launch from Python, with the wrapper's checks


# Datasheet bandwidth and dense bf16 peak (989 TFLOP/s for both SXM parts). launch_us: back-to-
# back kernels on Hopper start ~2-4 us apart once the GPU, not the host, is the bottleneck.
# Host costs: a small eager torch CUDA op costs ~5-10 us of CPU; a Triton launch with ~40
# arguments, plus this project's Python argument checks, ~20-40 us. L2: the rate at which the
# H200 run's 2D prefill attention re-read K/V tiles (2.15 GB in 0.535 ms at 2,048 tokens, 18.4
# GB in 4.03 ms at 6,000: ~4.5 TB/s both times); the H100 (same die, same L2) is given the same.
DEVICES = {
    "h200": Device("NVIDIA H200", 4.8e12, 989e12, 132, 4.5e12, 3.0, 8.0, 30.0),
    "h100": Device("NVIDIA H100 SXM", 3.35e12, 989e12, 132, 4.5e12, 3.0, 8.0, 30.0),
}
VLLM_SEGMENTS = 16          # triton_attn.py: NUM_PAR_SOFTMAX_SEGMENTS
VLLM_MIN_GRID_2D = 128      # triton_attn.py: MIN_LAUNCH_GRID_SIZE_2D
BLOCK_M = 16                # query-head lanes per program (vLLM's and h2o_attention's, group <= 16)
FINAL_TILE = 256            # keys per program of the design's reduce
PREFILL_TILE = 64           # accumulate_prefill_scores_from_lse: block_m = block_n = 64


@dataclass(frozen=True)
class Shape:
    rows: int
    kv_len: int
    q_len: int = 1           # 1: decode; > 1: one prompt of q_len tokens (rows = 1)
    kv_heads: int = 8
    group: int = 4
    head: int = 128
    block: int = 16
    elem: int = 2            # bytes per cache element (bf16)
    evict: int = 16          # kv_len - target of a compacting row (the cadence: one block)
    sinks: int = 0
    due: bool = False
    due_groups: int = 1      # today: due rows grouped by (kv_len, budget, ...) in Python
    obs_window: int | None = None

    @property
    def target(self) -> int:
        return self.kv_len - self.evict

    @property
    def q_heads(self) -> int:
        return self.kv_heads * self.group


@dataclass(frozen=True)
class Launch:
    name: str
    programs: int           # live programs (the fill of the GPU)
    read: float             # HBM bytes
    write: float
    flops: float = 0.0      # tensor-core FLOPs issued (BLOCK_M lanes, live or not)
    l2: float = 0.0         # bytes re-read by tiles (prompts' 2D grids); 0: each byte once
    host: str = "triton"    # triton | torch
    kernels: int = 1        # GPU kernels behind it (a CUDA sort: several)

    def time_us(self, dev: Device, graph: bool) -> float:
        fill = min(1.0, self.programs / dev.sms)
        hbm = self.read + self.write
        roof = max(hbm / dev.hbm_bytes_per_s, self.l2 / dev.l2_bytes_per_s,
                   self.flops / dev.tensor_flops)
        gpu = self.kernels * dev.launch_us + roof / fill * 1e6
        host = 0.0 if graph else (dev.host_triton_us if self.host == "triton" else dev.host_torch_us)
        return max(gpu, host)


def uses_3d(s: Shape) -> bool:
    return s.q_len == 1 and s.rows <= VLLM_MIN_GRID_2D // s.kv_heads


def kv_bytes(s: Shape, tokens: float) -> float:
    """K and V of `tokens` tokens of every (row, KV head)."""
    return s.rows * s.kv_heads * tokens * 2 * s.head * s.elem


def q_bytes(s: Shape) -> float:
    return s.rows * s.q_len * s.q_heads * s.head * s.elem


def table_bytes(s: Shape) -> float:
    return s.rows * math.ceil(s.kv_len / s.block) * 4


def program_keys(s: Shape) -> int:
    """Keys all programs of one KV head load: a 2D grid re-reads a prompt's keys per query block."""
    if s.q_len == 1:
        return s.rows * s.kv_len
    per_q_block = BLOCK_M // s.group
    return s.rows * sum(s.kv_len - s.q_len + min((j + 1) * per_q_block, s.q_len)
                        for j in range(math.ceil(s.q_len / per_q_block)))


def attention_flops(s: Shape) -> float:
    """Q.K and P.V as the tensor cores run them: BLOCK_M lanes per program, causal tiles."""
    return s.kv_heads * program_keys(s) * BLOCK_M * s.head * 2 * 2


def attention_l2(s: Shape) -> float:
    return s.kv_heads * program_keys(s) * 2 * s.head * s.elem + q_bytes(s) + table_bytes(s)


def attention_programs(s: Shape) -> int:
    """Live programs of a 2D grid: (row, BLOCK_M // group queries) x KV head."""
    return s.rows * math.ceil(s.q_len / (BLOCK_M // s.group)) * s.kv_heads


def vllm(s: Shape) -> list[Launch]:
    base = dict(read=kv_bytes(s, s.kv_len) + q_bytes(s) + table_bytes(s), flops=attention_flops(s),
                l2=attention_l2(s) if s.q_len > 1 else 0.0)
    if not uses_3d(s):
        return [Launch("vllm 2D attention", attention_programs(s), write=q_bytes(s), **base)]
    part = s.rows * s.q_heads * VLLM_SEGMENTS * (s.head * 4 + 8)  # fp32 partial out, max, sum
    return [Launch("vllm 3D attention", s.rows * s.kv_heads * VLLM_SEGMENTS, write=part, **base),
            Launch("vllm reduce_segments", s.rows * s.q_heads, read=part, write=q_bytes(s))]


def today_attention(s: Shape) -> list[Launch]:
    """kernels.h2o_attention with scores; for prompts, pass 2 over K with the LSE."""
    rh = s.rows * s.kv_heads
    base = dict(read=kv_bytes(s, s.kv_len) + q_bytes(s) + table_bytes(s), flops=attention_flops(s))
    if s.q_len == 1:
        logits, scores = rh * s.group * s.kv_len * 4, rh * s.kv_len * 4
        return [Launch("h2o fused attention + scores", rh, read=base["read"] + logits + scores,
                       write=q_bytes(s) + logits + scores, flops=base["flops"])]
    base["l2"] = attention_l2(s)
    lse = s.q_len * s.q_heads * 4
    first = s.q_len - s.obs_window if s.obs_window else 0
    lanes = 0  # (query, head) lanes of the query tiles every KV-tile program loops over
    for n0 in range(0, s.kv_len, PREFILL_TILE):
        start = max(n0 - (s.kv_len - s.q_len), first) * s.group // PREFILL_TILE * PREFILL_TILE
        lanes += (s.q_len * s.group - start) * s.kv_heads
    flops = lanes * PREFILL_TILE * s.head * 2
    return [Launch("h2o fused attention + lse", attention_programs(s), write=q_bytes(s) + lse, **base),
            Launch("h2o prefill scores (pass 2)", s.kv_heads * math.ceil(s.kv_len / PREFILL_TILE),
                   read=kv_bytes(s, s.kv_len) / 2 + q_bytes(s) + lse, write=s.kv_len * s.kv_heads * 4,
                   flops=flops, l2=kv_bytes(s, s.kv_len) / 2 + lanes * (s.head * s.elem + 4))]


def moved_ordered(s: Shape) -> int:
    """Kept tokens that move in an order-keeping compaction, worst case: every one after the
    sinks (the first evicted token right after them)."""
    return s.target - s.sinks


def today_compaction(s: Shape) -> list[Launch]:
    """worker/step.py's due-group loop: select_keep and the mass as torch ops, compact_rows."""
    out = [Launch("torch zeros (mass)", 1, 0, 8, host="torch")]
    rows = s.rows / s.due_groups
    live = rows * s.kv_heads * s.kv_len * 4
    heavy = (s.target - s.sinks) // 2  # the H200 run's budget: half heavy, half recent
    recent = s.target - s.sinks - heavy
    cand = rows * s.kv_heads * (s.kv_len - recent - s.sinks)
    keep = rows * s.kv_heads * s.target
    sel = rows * s.kv_heads * heavy
    moved = rows * s.kv_heads * moved_ordered(s)
    for _ in range(s.due_groups):
        # A torch kernel's grid covers its tensor (fills the GPU); a sort runs per (row, head).
        t = lambda name, r, w, k=1: Launch(name, 1 << 20 if k == 1 else rows * s.kv_heads, r, w,  # noqa: E731
                                           host="torch", kernels=k)
        out += [t("torch index (gather scores)", live + rows * s.kv_len * 8, live),
                t("torch arange (recent)", 0, recent * 8), t("torch flip", cand * 4, cand * 4),
                t("torch sort (scores)", cand * 4, cand * 12, 3), t("torch rsub", sel * 8, sel * 8),
                t("torch sort (indices)", sel * 8, sel * 16, 3), t("torch cat (keep)", sel * 8, keep * 8),
                t("torch sum (mass)", live, 4), t("torch add_+copy_ (mass)", 8, 8, 2),
                t("torch gather (kept)", keep * 12, keep * 4), t("torch sum (kept)", keep * 4, 4),
                t("torch add_+copy_ (mass)", 8, 8, 2),
                Launch("h2o compact_rows", int(rows * s.kv_heads * 4),
                       read=keep * 8 + moved * (2 * s.head * s.elem + 4),
                       write=moved * (2 * s.head * s.elem + 4))]
    return out


def today(s: Shape) -> list[Launch]:
    return today_attention(s) + (today_compaction(s) if s.due else [])


def design_splits(s: Shape) -> int:
    return VLLM_SEGMENTS if uses_3d(s) else 1


def design(s: Shape, compaction: str = "fill") -> list[Launch]:
    """Split-KV fused attention + reduce/finalise + select/compact over every row (decode);
    prompts keep today's kernels."""
    if s.q_len > 1:
        return today_attention(s)
    splits = design_splits(s)
    rh = s.rows * s.kv_heads
    logits, ml = rh * s.group * s.kv_len * 4, rh * s.group * splits * 8
    part = rh * s.group * splits * s.head * 4 if splits > 1 else 0
    out_direct = 0 if splits > 1 else q_bytes(s)
    tag = rh * 4 if compaction == "fill" else 0  # the new slot's position tag
    launches = [
        Launch(f"design split-KV attention (S={splits})", rh * splits,
               read=kv_bytes(s, s.kv_len) + q_bytes(s) + table_bytes(s),
               write=logits + ml + part + out_direct + tag, flops=attention_flops(s)),
        Launch("design reduce + finalise scores", rh * math.ceil(s.kv_len / FINAL_TILE),
               read=logits + ml + part + rh * (s.kv_len - 1) * 4 + table_bytes(s),
               write=rh * s.kv_len * 4 + (q_bytes(s) if splits > 1 else 0))]
    if not s.due:  # replayed every step: each program reads its row's due flag and stops
        return launches + [Launch("design select + compact (none due)", rh, s.rows * 4, 0)]
    per_token = 2 * s.head * s.elem + (8 if compaction == "fill" else 4)  # K, V, score (+ tag)
    moved = rh * (s.evict if compaction == "fill" else moved_ordered(s))
    return launches + [Launch(f"design select + compact ({compaction})", rh,
                              read=s.rows * 16 + rh * s.kv_len * (8 if compaction == "fill" else 4)
                              + table_bytes(s) + moved * per_token,
                              write=moved * per_token + rh * 8)]


def total_us(launches: list[Launch], dev: Device, graph: bool) -> float:
    return sum(x.time_us(dev, graph) for x in launches)


def evaluate(name: str, s: Shape, dev: Device) -> dict:
    """Every side's launches and times, and H2O's extra cost over vLLM's attention."""
    base = {"eager": total_us(vllm(s), dev, False), "graph": total_us(vllm(s), dev, s.q_len == 1)}
    sides = {"vllm": vllm(s), "today": today(s), "design": design(s),
             "design-ordered": design(s, "ordered")}
    out = {"case": name, "shape": dataclasses.asdict(s), "vllm_3d": uses_3d(s),
           "design_splits": design_splits(s) if s.q_len == 1 else None, "sides": {}}
    graph = s.q_len == 1  # prompts run eagerly (FULL_DECODE_ONLY graphs hold decode steps only)
    for side, launches in sides.items():
        rows = [{"name": x.name, "programs": x.programs, "read_mb": x.read / 1e6,
                 "write_mb": x.write / 1e6, "l2_mb": x.l2 / 1e6,
                 "gflops": x.flops / 1e9, "kernels": x.kernels,
                 "eager_us": x.time_us(dev, False), "graph_us": x.time_us(dev, graph)}
                for x in launches]
        times = {mode: sum(r[f"{mode}_us"] for r in rows) for mode in ("eager", "graph")}
        out["sides"][side] = {
            "launches": rows, "kernels": sum(x.kernels for x in launches),
            "hbm_mb": sum(x.read + x.write for x in launches) / 1e6,
            **{f"{mode}_us": t for mode, t in times.items()},
            **{f"extra_vs_vllm_{mode}": (times[mode] - base[mode]) / base[mode] for mode in times}}
    return out


def cases(a: argparse.Namespace) -> list[tuple[str, Shape]]:
    common = dict(kv_heads=a.kv_heads, group=a.group, head=a.head_size, block=a.block_size,
                  elem=a.elem_bytes, evict=a.evict or a.block_size)
    out = []
    for rows, kv in ((a.rows, a.kv_len), *a.extra_decode):
        for due in (False, True):
            out.append((f"{'compacting' if due else 'decode'} {rows}x{kv}",
                        Shape(rows, kv, due=due, **common)))
    for p in a.prompt_lens:
        for w in (None, a.obs_window):
            out.append((f"prefill {p}" + (f" window {w}" if w else ""),
                        Shape(1, p, q_len=p, obs_window=w, **common)))
    return out


def calibrate(results: list[dict], path: Path) -> list[dict]:
    """The model's today-eager ratio beside the H200 run's measured one, case by case."""
    if not path.exists():
        return []
    measured = json.loads(path.read_text())["cases"]
    rows = []
    for r in results:
        s = r["shape"]
        for m in measured:
            if (m["rows"], m["kv_len"], m["q_len"], m["compacted"], m["obs_window"]) == (
                    s["rows"], s["kv_len"], s["q_len"], s["due"], s["obs_window"]) and m[
                    "num_kv_heads"] == s["kv_heads"] and m["head_size"] == s["head"]:
                rows.append({"case": r["case"], "measured": m["h2o_extra_vs_attention"],
                             "model_today": r["sides"]["today"]["extra_vs_vllm_eager"],
                             "measured_attention_us": m["plain_attention_ms"] * 1e3,
                             "model_attention_us": r["sides"]["vllm"]["eager_us"]})
    return rows


def table(results: list[dict], calib: list[dict]) -> str:
    lines = ["| case | vLLM attention | today (eager) | design (graph) | design (eager) | "
             "design-ordered (graph) | measured today |", "|---" * 7 + "|"]
    meas = {c["case"]: c["measured"] for c in calib}
    for r in results:
        sd = r["sides"]
        v = sd["vllm"]
        measured = f"{meas[r['case']]:.2f}x" if r["case"] in meas else "-"
        lines.append(
            f"| {r['case']} | {v['graph_us']:.1f} us, {v['hbm_mb']:.0f} MB, {v['kernels']} kernel(s)"
            f"{' (3D)' if r['vllm_3d'] else ''} | {sd['today']['extra_vs_vllm_eager']:.2f}x | "
            f"{sd['design']['extra_vs_vllm_graph']:.2f}x | {sd['design']['extra_vs_vllm_eager']:.2f}x | "
            f"{sd['design-ordered']['extra_vs_vllm_graph']:.2f}x | "
            f"{measured} |")
    return "\n".join(lines)


def plot(results: list[dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    sides = ("vllm", "today", "design", "design-ordered")
    fig, axes = plt.subplots(len(results), 1, figsize=(11, 1.9 * len(results)), squeeze=False)
    for ax, r in zip(axes[:, 0], results):
        for i, side in enumerate(sides):
            left, mode = 0.0, "eager" if side == "today" or r["shape"]["q_len"] > 1 else "graph"
            for j, x in enumerate(r["sides"][side]["launches"]):
                ax.barh(i, x[f"{mode}_us"], left=left, color=plt.cm.tab20(j % 20), edgecolor="k",
                        linewidth=0.3)
                left += x[f"{mode}_us"]
        prompt = r["shape"]["q_len"] > 1
        ax.set_yticks(range(len(sides)), [f"{s} ({'eager' if s == 'today' or prompt else 'graph'})"
                                           for s in sides], fontsize=7)
        ax.set_title(r["case"], fontsize=8)
        ax.tick_params(axis="x", labelsize=7)
    axes[-1, 0].set_xlabel("modelled us per layer (one bar segment per launch)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def pairs(text: str) -> list[tuple[int, int]]:
    return [tuple(int(v) for v in p.split("x")) for p in text.split(",") if p]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", choices=sorted(DEVICES), default="h200")
    p.add_argument("--rows", type=int, default=64, help="decode rows (the H200 run's 64)")
    p.add_argument("--kv-len", type=int, default=1024)
    p.add_argument("--extra-decode", type=pairs, default=pairs("256x512,4x32768"),
                   help="more ROWSxKV decode shapes (default: the run's second, and a long context)")
    p.add_argument("--prompt-lens", type=lambda t: [int(v) for v in t.split(",") if v],
                   default=[2048, 6000])
    p.add_argument("--obs-window", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--group", type=int, default=4, help="query heads per KV head")
    p.add_argument("--head-size", type=int, default=128)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--elem-bytes", type=int, default=2, help="cache bytes per element (bf16: 2)")
    p.add_argument("--evict", type=int, default=0, help="tokens a compacting row evicts (0: one block)")
    p.add_argument("--measured", type=Path, default=MEASURED, help="cuda_step_timing.json to calibrate on")
    p.add_argument("--out", type=Path, default=None,
                   help="output directory (default benchmarks/results/<date>-traffic-model)")
    p.add_argument("--no-plot", action="store_true")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    a = parse_args(argv)
    dev = DEVICES[a.device]
    results = [evaluate(name, s, dev) for name, s in cases(a)]
    calib = calibrate(results, a.measured) if a.device == "h200" else []
    out = a.out or ROOT / "benchmarks/results" / f"{time.strftime('%Y-%m-%d')}-traffic-model"
    out.mkdir(parents=True, exist_ok=True)
    doc = {"device": dataclasses.asdict(dev), "cases": results, "calibration": calib}
    (out / f"traffic_model-{a.device}.json").write_text(json.dumps(doc, indent=1))
    md = table(results, calib)
    (out / f"traffic_model-{a.device}.md").write_text(md + "\n")
    if not a.no_plot:
        plot(results, out / f"traffic_model-{a.device}.png")
    print(f"{dev.name}: H2O's extra time over vLLM's attention, per layer\n{md}")
    for c in calib:
        print(f"calibration {c['case']}: model today {c['model_today']:.2f}x, measured "
              f"{c['measured']:.2f}x; attention model {c['model_attention_us']:.0f} us, measured "
              f"{c['measured_attention_us']:.0f} us")
    return doc


if __name__ == "__main__":
    main()
