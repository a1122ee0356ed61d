"""benchmarks/quality_suite.py's labels and table without engines."""
import pytest


@pytest.fixture(scope="module")
def suite(load_benchmark):
    return load_benchmark("quality_suite")


@pytest.fixture(scope="module")
def report(load_benchmark):
    return load_benchmark("quality_suite_report")


def test_each_policy_runs_held_whole_and_with_each_chunk(suite):
    args = suite.parse_args(["--policies", "h2o,random", "--budgets", "0.2", "--chunks", "128,256"])
    assert suite.labels(args) == [
        ("full", "full", None), ("h2o-20%", "h2o", 0.2), ("h2o@c128-20%", "h2o@c128", 0.2),
        ("h2o@c256-20%", "h2o@c256", 0.2), ("random-20%", "random", 0.2),
        ("random@c128-20%", "random@c128", 0.2), ("random@c256-20%", "random@c256", 0.2)]
    assert suite.labels(suite.parse_args(["--policies", ""])) == [("full", "full", None)]


def test_the_table_has_a_row_per_label_and_the_ratio(report):
    entry = lambda pol, b, a, s, r: {"policy": pol, "budget": b, "tasks": {"niah": a, "vt": 0.5},  # noqa: E731
                                     "num_samples": {"niah": 4, "vt": 4}, "suite": s, "suite_ratio_to_full": r}
    result = {"policies": {"full": entry("full", None, 1.0, 0.75, 1.0),
                           "h2o@c256-20%": entry("h2o@c256", 0.2, 0.5, 0.5, 0.5 / 0.75)}}
    table = report.markdown_table(result).splitlines()
    assert table[0] == "| policy | budget | prefill chunk | niah (n=4) | vt (n=4) | suite | x full |"
    assert table[2] == "| full cache | - | - | 1.00 | 0.50 | **0.750** | 1.00 |"
    assert table[3] == "| h2o | 20% | 256 | 0.50 | 0.50 | **0.500** | 0.67 |"
    assert report.split("window+pool@c64") == ("window+pool", 64) and report.split("h2o") == ("h2o", None)


def test_runs_that_split_the_grid_merge_in_a_runs_order(suite, tmp_path):
    import json
    full = [{"task": "a", "id": "a-0", "answers": ["x"], "text": "x"}]

    def run(name, budgets):
        labels = {f"h2o-{round(b * 100)}%": {"policy": "h2o", "budget": b} for b in budgets}
        outputs = {"full": full, **{lab: [{**full[0], "text": "no"}] for lab in labels}}
        (tmp_path / name).mkdir()
        (tmp_path / name / "quality_suite.json").write_text(json.dumps(
            {"meta": {"model": "m"}, "policies": {"full": {"policy": "full", "budget": None}, **labels},
             "outputs": outputs}))
        return tmp_path / name

    merged = suite.merge([run("r20", [0.2]), run("r5010", [0.5, 0.1])], tmp_path / "merged")
    assert list(merged["policies"]) == ["full", "h2o-50%", "h2o-20%", "h2o-10%"]
    assert merged["policies"]["h2o-20%"]["suite_ratio_to_full"] == 0.0
    assert (tmp_path / "merged" / "quality_suite.md").exists()
