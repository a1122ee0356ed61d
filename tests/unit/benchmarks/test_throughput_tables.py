"""benchmarks/throughput.py's tables without engines: ratios paired within a round, and with
``--repeat`` the medians over rounds with the ratios' range (tests/engine/test_benchmarks_run.py
runs the script end to end once)."""
import pytest


@pytest.fixture(scope="module")
def throughput(load_benchmark):
    return load_benchmark("throughput")


def _run(config, round_, tok_s):
    return {"workload": "synthetic", "config": config, "policy": config, "budget": None,
            "round": round_, "total_tok_s": tok_s, "output_tok_s": tok_s / 2, "mean_running": 2.0,
            "peak_running": 3, "mean_blocks_used": 25.0, "peak_blocks_used": 31, "num_preemptions": 6}


def test_repeated_runs_pair_each_ratio_within_its_round(throughput):
    # The machine slows down in round 1: stock's median over full's median would say 0.90,
    # the paired ratios say 1.0 and 0.95.
    runs = [_run("stock", 0, 50.0), _run("full", 0, 50.0), _run("stock", 1, 40.0), _run("full", 1, 38.0),
            _run("stock", 2, 60.0), _run("full", 2, 54.0)]
    throughput.add_ratios(runs)
    assert [r["total_ratio_to_stock"] for r in runs] == pytest.approx([1, 1, 1, 0.95, 1, 0.9])
    full = next(r for r in throughput.medians(runs) if r["config"] == "full")
    assert full["total_ratio_to_stock"] == pytest.approx(0.95)
    assert full["total_ratio_range"] == pytest.approx((0.9, 1.0))
    assert full["total_tok_s"] == 50.0 and full["rounds"] == 3
    table = throughput.markdown_table({"meta": {"args": {"repeat": 3}}, "runs": runs})
    assert "| synthetic | full (tracking only) | 50.0 | 25.0 | 0.95 (0.90-1.00) |" in table
    assert len(table.strip().splitlines()) == 4  # header, rule, one row per config


def test_one_round_keeps_one_row_per_run(throughput):
    runs = [_run("stock", 0, 50.0), _run("full", 0, 45.0)]
    throughput.add_ratios(runs)
    table = throughput.markdown_table({"meta": {"args": {"repeat": 1}}, "runs": runs})
    assert "| synthetic | full (tracking only) | 45.0 | 22.5 | 0.90 |" in table


def test_a_stock_engine_with_shorter_steps_is_a_configuration_against_plain_stock(throughput):
    assert throughput.parse_config("stock@b256") == ("stock@b256", "stock", None, 256, False)
    assert throughput.parse_config("h2o@c256@b512:0.2") == ("h2o@c256@b512-20%", "h2o@c256", 0.2, 512, False)
    assert throughput.parse_config("h2o:0.2") == ("h2o-20%", "h2o", 0.2, None, False)
    assert throughput.parse_config("h2o:0.2+fp8") == ("h2o-20%+fp8", "h2o", 0.2, None, True)
    assert throughput.parse_config("stock+fp8") == ("stock+fp8", "stock", None, None, True)
    assert throughput.fp8_blocks(100, "bfloat16") == 200 and throughput.fp8_blocks(100, "float32") == 400
    with pytest.raises(ValueError, match="stock@b256"):
        throughput.parse_config("stock@bx")
    runs = [{**_run("stock@b256", 0, 60.0), "policy": "stock", "max_num_batched_tokens": 256},
            _run("stock", 0, 50.0)]
    throughput.add_ratios(runs)
    assert [r["total_ratio_to_stock"] for r in runs] == pytest.approx([1.2, 1.0])
    table = throughput.markdown_table({"meta": {"args": {"repeat": 1}}, "runs": runs})
    assert "| synthetic | stock vLLM, 256 tokens a step | 60.0 | 30.0 | 1.20 |" in table
