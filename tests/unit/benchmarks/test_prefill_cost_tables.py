"""benchmarks/prefill_cost.py without servers: the runs each side makes (single and concurrent
loads per length), the bench command each load gets, and the ratio rows, table and plot over
both loads. tests/engine/test_benchmarks_run.py runs the script end to end against real servers
at the single load only: the concurrent load differs only in the numbers checked here (each
bench run there is a subprocess importing vLLM, ~20-30 s on 2 cores)."""
import pytest


@pytest.fixture(scope="module")
def prefill_cost(load_benchmark):
    return load_benchmark("prefill_cost")


def _opt(cmd, flag):
    return cmd[cmd.index(flag) + 1]


def test_runs_cover_every_length_and_load(prefill_cost):
    args = prefill_cost.parse_args(["--lengths", "96,512", "--single-prompts", "1",
                                    "--concurrent-prompts", "2", "--concurrency", "2"])
    assert prefill_cost.runs(args) == [(96, "single", 1, 1), (96, "concurrent2", 2, 2),
                                       (512, "single", 1, 1), (512, "concurrent2", 2, 2)]
    only_single = prefill_cost.parse_args(["--lengths", "96", "--concurrent-prompts", "0"])
    assert prefill_cost.runs(only_single) == [(96, "single", 2, 1)]
    only_concurrent = prefill_cost.parse_args(["--lengths", "96", "--single-prompts", "0"])
    assert prefill_cost.runs(only_concurrent) == [(96, "concurrent4", 4, 4)]


def test_bench_command_carries_each_loads_prompts_and_concurrency(prefill_cost, tmp_path):
    args = prefill_cost.parse_args(["--output-len", "8", "--seed", "3"])
    cmd = prefill_cost.bench_command(args, "http://127.0.0.1:1", "served", "/m", 96, 2, 2,
                                     tmp_path, "h2o-96-concurrent2")
    assert cmd[1:3] == ["bench", "serve"]
    assert _opt(cmd, "--random-input-len") == "96" and _opt(cmd, "--random-output-len") == "8"
    assert _opt(cmd, "--num-prompts") == "2" and _opt(cmd, "--max-concurrency") == "2"
    assert _opt(cmd, "--request-rate") == "inf" and "--ignore-eos" in cmd
    assert _opt(cmd, "--seed") == "3" and _opt(cmd, "--result-filename") == "h2o-96-concurrent2.json"


def _run(length, load, ttft, itl, tput):
    return {"prompt_len": length, "load": load, "mean_ttft_ms": ttft, "median_itl_ms": itl,
            "output_throughput": tput}


def _report():
    return {"model_name": "tiny", "args": {"output_len": 8, "block_size": 32, "omp_threads": "1"},
            "sides": {
                "stock": {"runs": [_run(96, "single", 100.0, 10.0, 50.0),
                                   _run(96, "concurrent2", 200.0, 20.0, 80.0)]},
                "h2o": {"runs": [_run(96, "single", 150.0, 11.0, 40.0),
                                 _run(96, "concurrent2", 300.0, 22.0, 60.0)]}}}


def test_ratio_rows_pair_each_load_with_stocks_same_load(prefill_cost):
    rows = prefill_cost.ratio_rows(_report())
    assert [(r["length"], r["load"]) for r in rows] == [(96, "single"), (96, "concurrent2")]
    single, concurrent = (r["sides"]["h2o"] for r in rows)
    assert single["ttft_vs_stock"] == pytest.approx(1.5)
    assert concurrent["ttft_vs_stock"] == pytest.approx(1.5)
    assert concurrent["throughput_vs_stock"] == pytest.approx(0.75)
    assert rows[1]["sides"]["stock"]["ttft_vs_stock"] == pytest.approx(1.0)


def test_table_and_plot_over_both_loads(prefill_cost, tmp_path):
    report = _report()
    report["rows"] = prefill_cost.ratio_rows(report)
    table = prefill_cost.markdown_table(report)
    lines = table.splitlines()
    assert len(lines) == 4  # header, rule, one row per (length, load)
    assert lines[2].startswith("| 96 | single | 0.10 | 0.15 | **1.50x** |")
    assert lines[3].startswith("| 96 | concurrent2 | 0.20 | 0.30 | **1.50x** |")
    assert lines[3].endswith("| 20.0 | 22.0 | 0.75x |")
    prefill_cost.plot(report, tmp_path / "p.png")
    assert (tmp_path / "p.png").stat().st_size > 0
