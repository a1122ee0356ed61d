"""The benchmark scripts run end to end at a tiny size and write their JSON and PNG.

Not a measurement: benchmarks/README.md has the real commands. Each config still starts a
fresh engine in a subprocess, as the real runs do (~20 s each on 2 cores); prefix_serving.py
starts a fresh `h2o-vllm serve` per side (~30-50 s each).
"""
import json

import pytest


def test_throughput_benchmark_runs(load_benchmark, tiny_llama_dir, tmp_path):
    """The default pool (room for 2 full sequences: 6 blocks of 32) admits two 40-token prompts
    that then outgrow it: stock vLLM preempts, and vLLM's own counter says so."""
    out = tmp_path / "throughput"
    result = load_benchmark("throughput").main([
        "--model", str(tiny_llama_dir), "--workloads", "synthetic", "--configs", "stock,h2o:0.2",
        "--num-requests", "3", "--prompt-len", "40", "--output-len", "56", "--out", str(out)])
    saved = json.loads((out / "throughput.json").read_text())
    assert (out / "throughput.png").stat().st_size > 0
    assert [r["config"] for r in saved["runs"]] == ["stock", "h2o-20%"]
    assert saved["runs"][0]["num_preemptions"] > 0
    assert set(saved["runs"][0]["held_blocks"]) == {"global"}  # one full-attention group
    for run in saved["runs"]:
        assert run["output_tokens"] == 3 * 56 and run["prompt_tokens"] == 3 * 40
        assert run["total_tok_s"] > 0 and run["peak_running"] >= 1 and run["peak_blocks_used"] >= 1
    assert saved["runs"][0]["total_ratio_to_stock"] == pytest.approx(1.0)
    assert result["meta"]["num_blocks"] == saved["meta"]["num_blocks"]


def test_quality_benchmark_runs(load_benchmark, tiny_llama_dir, tmp_path):
    out = tmp_path / "quality"
    load_benchmark("quality").main([
        "--model", str(tiny_llama_dir), "--texts", "gpl3", "--budgets", "0.5,0.2",
        "--policies", "h2o,local,window+sinks", "--ppl-prompt-len", "40", "--ppl-continuation-len", "8", "--gen-prompts", "2",
        "--gen-prompt-len", "40", "--gen-len", "8", "--passkey-samples", "2", "--passkey-filler", "40",
        "--out", str(out)])
    saved = json.loads((out / "quality.json").read_text())
    assert (out / "quality.png").stat().st_size > 0
    assert set(saved["policies"]) == {"full", "h2o-50%", "h2o-20%", "local-50%", "local-20%",
                                      "window+sinks-50%", "window+sinks-20%"}
    full = saved["policies"]["full"]
    assert full["token_agreement"] == 1.0 and full["ppl"]["gpl3"]["ppl_ratio_to_full"] == 1.0
    for entry in saved["policies"].values():
        assert entry["ppl"]["gpl3"]["tokens"] == 8
        assert 0.0 <= entry["rouge_l"] <= 1.0 and 0.0 <= entry["passkey_accuracy"] <= 1.0


def test_quality_suite_runs(load_benchmark, tiny_llama_dir, tmp_path):
    """Every label comes back scored, the benchmark-only random policy included (its score mode
    registered in the H2O engine's process), held whole and chunked."""
    out = tmp_path / "suite"
    load_benchmark("quality_suite").main([
        "--model", str(tiny_llama_dir), "--tasks", "niah_single,qa_end,passkey", "--samples", "1",
        "--policies", "h2o,random", "--budgets", "0.5", "--chunks", "32", "--context-len", "96",
        "--out", str(out)])
    saved = json.loads((out / "quality_suite.json").read_text())
    assert (out / "quality_suite.png").stat().st_size > 0
    assert list(saved["policies"]) == ["full", "h2o-50%", "h2o@c32-50%", "random-50%", "random@c32-50%"]
    for label, entry in saved["policies"].items():
        assert set(entry["tasks"]) == {"niah_single", "qa_end", "passkey"}
        assert len(saved["outputs"][label]) == 3


def test_prefix_serving_benchmark_runs(load_benchmark, tiny_llama_dir, tmp_path):
    """One of the three sides against a real server (the other two differ only in their flags,
    checked here without a server; one server instead of two saves ~100 s of the suite): vLLM's
    bench serve completes every request, the hit rate comes from the server's counters, H2O's
    score records from its gauge and stay within their bound."""
    module = load_benchmark("prefix_serving")
    args = module.parse_args(["--tiny", "--num-blocks", "20"])
    args.max_model_len = 192
    flags = {side: module.side_flags(args, side) for side in module.SIDES}
    assert flags["stock-pc"][1]["VLLM_PLUGINS"] == module.soak.STOCK_PLUGINS
    assert "--enable-prefix-caching" in flags["stock-pc"][0]
    assert flags["h2o-nopc"][0][-3:] == ["--kv-eviction", "h2o", "--no-enable-prefix-caching"]
    assert flags["h2o-pc"][0][-3:] == ["--kv-eviction", "h2o", "--enable-prefix-caching"]
    assert len({tuple(f[:11]) for f, _ in flags.values()}) == 1     # same pool, dtype, seed, length

    out = tmp_path / "prefix"
    report = module.main(["--model", str(tiny_llama_dir), "--tiny", "--sides", "h2o-pc",
                          "--out", str(out)])
    saved = json.loads((out / "prefix_serving.json").read_text())
    assert (out / "prefix_serving.png").stat().st_size > 0
    assert (out / "prefix_serving.md").read_text().count("\n") == 3
    h2o = saved["sides"]["h2o-pc"]
    assert h2o["completed"] == args.num_prompts and h2o["failed"] == 0 and h2o["idle_at_end"]
    assert h2o["total_output_tokens"] == args.num_prompts * args.output_len
    assert h2o["cache_config"]["num_gpu_blocks"] == str(report["num_blocks"])
    assert h2o["prefix_cache_queries"] == h2o["prompt_tokens"] > 0
    assert h2o["mean_ttft_ms"] > 0 and h2o["output_throughput"] > 0
    assert h2o["prefix_cache_hits"] > 0 and h2o["score_record_tokens"] > 0
    shape = saved["model_shape"]
    assert h2o["score_record_bytes"] == h2o["score_record_tokens"] * 4 * shape["num_layers"] * shape["num_kv_heads"]
    # The record pool holds at most one fp32 per KV slot per (layer, KV head).
    assert 0 < h2o["score_record_fraction_of_kv"] <= 2 / (shape["head_dim"] * 4)


def test_prefill_cost_benchmark_runs(load_benchmark, tiny_llama_dir, tmp_path):
    """H2O's side against a real server: vLLM's bench serve completes every request and the
    report and table are written. Stock's side differs only in its flags and plugins, checked
    here without a server (a second server and bench subprocess cost ~100 s of the suite); the
    ratio to stock and the concurrent load's rows are checked without servers in
    tests/unit/benchmarks/test_prefill_cost_tables.py."""
    module = load_benchmark("prefill_cost")
    args = module.parse_args(["--omp-threads", "1"])
    (stock, stock_env), (h2o, h2o_env) = (module.side_flags(args, side, 160) for side in ("stock", "h2o"))
    assert stock_env["VLLM_PLUGINS"] == module.soak.STOCK_PLUGINS and "VLLM_PLUGINS" not in h2o_env
    assert h2o[:len(stock)] == stock and "--kv-eviction" not in stock  # same pool, dtype, seed, length

    out = tmp_path / "prefill"
    module.main([
        "--model", str(tiny_llama_dir), "--sides", "h2o", "--lengths", "96", "--output-len", "8",
        "--single-prompts", "1", "--concurrent-prompts", "0", "--omp-threads", "1", "--out", str(out)])
    saved = json.loads((out / "prefill_cost.json").read_text())
    assert (out / "prefill_cost.png").stat().st_size > 0
    side = saved["sides"]["h2o"]
    assert [(r["prompt_len"], r["load"]) for r in side["runs"]] == [(96, "single")]
    assert all(r["completed"] == r["num_prompts"] and r["failed"] == 0 for r in side["runs"])
    assert side["serve_flags"][-len(module.SIDES["h2o"]):] == module.SIDES["h2o"]
    assert len(saved["rows"]) == 1 and saved["rows"][0]["sides"]["h2o"]["mean_ttft_ms"] > 0
    assert (out / "prefill_cost.md").read_text().count("\n") == 3  # header, rule, one row


def test_prefill_profile_runs(load_benchmark, tiny_llama_dir, tmp_path):
    """Every part of an H2O prefill is timed and the parts add up to the wall time."""
    out = tmp_path / "profile"
    results = load_benchmark("prefill_profile").main([
        "--model", str(tiny_llama_dir), "--configs", "h2o:0.2", "--prompt-len", "96", "--out", str(out)])
    parts = results[0]["parts_s"]
    assert parts["H2O attention + scores"] > 0 and parts["H2O compaction"] > 0
    assert sum(parts.values()) == pytest.approx(results[0]["wall_s"])
    assert json.loads((out / "prefill_profile.json").read_text())["results"] == results


def test_pd_transfer_benchmark_runs(load_benchmark, tiny_llama_dir, tmp_path):
    """Stock vLLM's ExampleConnector pair and H2O's, each beside one engine of twice the blocks:
    the pairs answer what their single engines do, and H2O's stores less per request."""
    out = tmp_path / "pd"
    load_benchmark("pd_transfer").main([
        "--model", str(tiny_llama_dir), "--num-requests", "3", "--prompt-len", "200", "--output-len", "6",
        "--num-blocks", "20", "--out", str(out)])
    saved = json.loads((out / "pd_transfer.json").read_text())
    assert (out / "pd_transfer.png").stat().st_size > 0 and "bytes stored" in (out / "pd_transfer.md").read_text()
    stock, h2o = saved["runs"]
    assert stock["system"] == "stock" and h2o["system"] == "h2o"
    for run in saved["runs"]:
        assert run["pair"]["same_tokens_as_single"], run["system"]
        assert run["consumer"]["output_tokens"] == 3 * 5
    assert h2o["bytes_per_request"] < 0.5 * stock["bytes_per_request"]
    assert not list(tmp_path.glob("pd-*"))  # the storage folders are temporary, outside --out
