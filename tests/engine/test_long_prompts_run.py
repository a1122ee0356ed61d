"""benchmarks/long_prompts.py runs end to end at a tiny size (capacity: two fresh engines,
~15-30 s each on 2 cores); the throughput and quality modes only build their flags here (the
scripts they call have their own run: test_benchmarks_run.py).

Not a measurement: benchmarks/README.md has the real commands.
"""
import json


def test_capacity_runs(load_benchmark, tiny_llama_dir, tmp_path):
    """A 200-token prompt, a 160-token pool: H2O holding the prompt whole refuses the request,
    H2O with prefill chunks completes within its predicted peak. (Stock vLLM refusing to start
    is vLLM's own check, left out to keep this under a minute.)"""
    out = tmp_path / "capacity"
    result = load_benchmark("long_prompts").main(["capacity", "--model", str(tiny_llama_dir), "--lengths", "200",
                           "--output-len", "8", "--num-blocks", "6",
                           "--configs", "h2o-req:0.2,tokens@c32:16+16", "--out", str(out)])
    saved = json.loads((out / "capacity.json").read_text())
    assert (out / "capacity.png").stat().st_size > 0 and "| H2O 16+16 tokens, chunk 32 | yes" in (
        out / "capacity.md").read_text()
    whole, chunked = saved["runs"]
    assert saved["pool_tokens"] == 160 and result["runs"] == saved["runs"]
    assert (whole["completed"], whole["stage"]) == (False, "request") and "h2o_prefill_chunk" in whole["error"]
    assert chunked["completed"] and chunked["num_preemptions"] == 0
    assert 0 < chunked["peak_blocks_allocated"] <= chunked["predicted_peak_blocks"] <= 5


def test_throughput_and_quality_flags(load_benchmark, tmp_path):
    module = load_benchmark("long_prompts")
    args = module.parse_args(["throughput"])
    argv = module.throughput_argv(args, "M", tmp_path)
    assert argv[argv.index("--num-blocks") + 1] == str(2 * 65 + 1)  # two 2,064-token sequences + null
    assert args.ceiling  # stock with memory for every request runs by default
    argv = module.throughput_argv(args, "M", tmp_path, "stock", args.num_requests)
    assert argv[argv.index("--num-blocks") + 1] == str(16 * 65 + 1)
    assert argv[argv.index("--configs") + 1] == "stock"
    args = module.parse_args(["quality", "--chunks", "64,256"])
    argv = module.quality_argv(args, "M", tmp_path)
    assert argv[argv.index("--policies") + 1] == "h2o,h2o@c64,h2o@c256,window+pool,window+pool@c64,window+pool@c256"
    from h2o_devtools import bench
    assert bench.h2o_config("window+pool@c64", 0.2) == {**bench.h2o_config("window+pool", 0.2), "prefill_chunk": 64}
