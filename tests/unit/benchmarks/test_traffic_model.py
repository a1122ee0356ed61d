"""benchmarks/traffic_model.py: bytes of a tiny shape counted by hand, monotonicity, and the
issue-58 proof on paper: at the H200 run's shapes the split-KV design costs at most 0.3x
vLLM's attention in decode and 1.5x in a step where every row compacts (docs/cuda.md,
"Split-KV decode: the design on paper"). The bounds are checked on the model's own numbers, so
a design change that moves more bytes or launches more kernels fails here."""
import dataclasses
import json

import pytest


@pytest.fixture(scope="module")
def tm(load_benchmark):
    return load_benchmark("traffic_model")


def _tiny(tm, **kw):
    # 2 rows x 32 keys, 1 KV head, group 2, head 4, block 16, 2-byte cache.
    return tm.Shape(rows=2, kv_len=32, kv_heads=1, group=2, head=4, block=16, elem=2, **kw)


def test_tiny_shape_bytes_by_hand(tm):
    s = _tiny(tm)
    # K+V: 2 rows x 1 head x 32 keys x (4 + 4) x 2 B = 1024; Q 2 x 2 heads x 4 x 2 B = 32;
    # block table 2 rows x 2 blocks x 4 B = 16.
    assert tm.uses_3d(s)  # 2 rows <= 128 // 1 KV head: vLLM splits the keys
    attn, reduce = tm.vllm(s)
    assert (attn.read, attn.write) == (1072, 2 * 2 * 16 * (4 * 4 + 8))  # partial out, max, sum
    assert (reduce.read, reduce.write) == (1536, 32)
    (fused,) = tm.today(s)
    # + logits 2 x 2 heads x 32 x 4 B = 512 written and read, scores 2 x 32 x 4 B = 256 each way
    assert (fused.read, fused.write) == (1072 + 512 + 256, 32 + 512 + 256)
    # vLLM's 2D grid when the rows fill it: 17 rows x 8 KV heads > 128 programs.
    two_d = tm.Shape(rows=17, kv_len=32, kv_heads=8, group=2, head=4)
    (attn,) = tm.vllm(two_d)
    assert not tm.uses_3d(two_d) and attn.programs == 17 * 8
    assert attn.read == 17 * 8 * 32 * 16 + 17 * 16 * 4 * 2 + 17 * 2 * 4


def test_tiny_compaction_bytes_by_hand(tm):
    s = _tiny(tm, due=True, evict=16)
    fill = tm.design(s)[-1]
    # fill: 2 rows x 16 tokens move, each K+V 16 B + score 4 + tag 4 = 24 B, read and written;
    # selection reads flags (2 x 16 B), scores + tags 2 x 32 x 8 B, the table 16 B.
    assert (fill.read, fill.write) == (32 + 512 + 16 + 768, 768 + 2 * 8)
    ordered = tm.design(s, "ordered")[-1]
    # ordered, worst case: every kept token (target 16, no sinks) moves: 2 x 16 x (16 + 4) B.
    assert ordered.write == 2 * 16 * 20 + 2 * 8
    compact = tm.today(s)[-1]
    assert compact.name == "h2o compact_rows"
    assert compact.write == 2 * 16 * 20 and compact.read == 2 * 16 * 8 + 2 * 16 * 20


@pytest.mark.parametrize("side", ["vllm", "today", "design", "design-ordered"])
def test_cost_grows_with_keys_rows_and_evictions(tm, side):
    dev = tm.DEVICES["h200"]

    def cost(**kw):
        s = tm.Shape(**{"rows": 16, "kv_len": 2048, "due": True, **kw})
        launches = {"vllm": tm.vllm, "today": tm.today, "design": tm.design,
                    "design-ordered": lambda x: tm.design(x, "ordered")}[side](s)
        return (sum(x.read + x.write for x in launches), tm.total_us(launches, dev, side != "today"))

    for key, values in (("kv_len", (512, 2048, 8192, 32768)), ("rows", (1, 16, 64, 256))):
        costs = [cost(**{key: v}) for v in values]
        for (b0, t0), (b1, t1) in zip(costs, costs[1:]):
            assert b1 > b0 and t1 > t0, (side, key, costs)
    # More evicted tokens: hole filling moves more of them; an order-keeping compaction moves
    # the kept tokens after the first hole, so fewer (its worst case has the hole first).
    costs = [cost(evict=v) for v in (16, 64, 256)]
    direction = {"vllm": 0, "design": 1}.get(side, -1)
    for (b0, _), (b1, _) in zip(costs, costs[1:]):
        assert (b1 > b0) - (b1 < b0) == direction, (side, costs)


def _ratio(tm, shape, side="design", mode="graph", device="h200"):
    return tm.evaluate("x", shape, tm.DEVICES[device])["sides"][side][f"extra_vs_vllm_{mode}"]


@pytest.mark.parametrize("device", ["h200", "h100"])
@pytest.mark.parametrize("rows,kv_len", [(64, 1024), (256, 512), (4, 32768)])
def test_design_meets_the_issue_limits(tm, device, rows, kv_len):
    """The proof on paper: decode <= 0.3x, every row compacting <= 1.5x vLLM's attention."""
    decode = tm.Shape(rows, kv_len)
    assert _ratio(tm, decode, device=device) <= 0.3
    assert _ratio(tm, dataclasses.replace(decode, due=True), device=device) <= 1.5


def test_the_limits_are_tight_enough_to_fail(tm):
    """What the design rules out fails the same bounds: an order-keeping compaction (every kept
    token after the first hole moves), and recomputing the logits (K read again, as the
    unfused score pass did) instead of storing them."""
    s = tm.Shape(64, 1024)
    assert _ratio(tm, dataclasses.replace(s, due=True), "design-ordered") > 1.5
    dev = tm.DEVICES["h200"]
    recompute = tm.design(s) + [tm.Launch("K again", 512, tm.kv_bytes(s, s.kv_len) / 2, 0)]
    base = tm.total_us(tm.vllm(s), dev, True)
    assert (tm.total_us(recompute, dev, True) - base) / base > 0.3


def test_today_model_against_the_h200_run(tm):
    """Calibration (docs/cuda.md): the compacting steps land within a factor 1.6 of the run;
    decode is the documented miss (the run's 1.05x is not traffic: the model's bytes give
    under 0.1x), and vLLM's decode attention is within 30 % of the run's plain kernel."""
    results = [tm.evaluate(n, s, tm.DEVICES["h200"]) for n, s in tm.cases(tm.parse_args([]))]
    calib = {c["case"]: c for c in tm.calibrate(results, tm.MEASURED)}
    for case in ("compacting 64x1024", "compacting 256x512"):
        c = calib[case]
        assert c["measured"] / 1.6 <= c["model_today"] <= c["measured"], c
    c = calib["decode 64x1024"]
    assert c["model_today"] < 0.1 < 1.0 < c["measured"]
    assert 0.7 <= c["model_attention_us"] / c["measured_attention_us"] <= 1.0


def test_cli_writes_json_table_and_plot(tm, tmp_path, capsys):
    doc = tm.main(["--out", str(tmp_path), "--extra-decode", "4x4096", "--prompt-lens", "256"])
    assert [c["case"] for c in doc["cases"]] == [
        "decode 64x1024", "compacting 64x1024", "decode 4x4096", "compacting 4x4096",
        "prefill 256", "prefill 256 window 32"]
    saved = json.loads((tmp_path / "traffic_model-h200.json").read_text())
    assert saved["cases"][0]["sides"]["design"]["launches"][0]["name"].startswith("design split-KV")
    assert (tmp_path / "traffic_model-h200.png").stat().st_size > 0
    assert "| decode 64x1024 |" in (tmp_path / "traffic_model-h200.md").read_text()
    assert "calibration decode 64x1024" in capsys.readouterr().out
