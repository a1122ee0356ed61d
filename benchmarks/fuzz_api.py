"""Property-based fuzzing of the served OpenAPI surface, H2O on and stock side by side.

    .venv/bin/python benchmarks/fuzz_api.py [--examples 40] [--tiny | --model DIR]

For each side (``h2o``: ``--kv-eviction h2o``; ``stock``: vLLM with no plugin loaded) a server
starts; schemathesis reads its ``/openapi.json`` and hypothesis draws ``--examples`` cases per
operation (POST /v1/completions, /v1/chat/completions, /v1/responses), each twice: as the schema
says, and with ``vllm_xargs`` holding H2O keys (valid names, a misspelt one, any JSON values).
Generation is derandomized, so both sides get the same cases; each body names the served model
and a completions case without a prompt gets one. The tiny model is served with a chat template. Afterwards each server must be
healthy with its KV pool idle. Writes ``fuzz.json`` (every case's status; each 5xx with its
body) under ``benchmarks/results/<date>-<host>/fuzz/`` and prints the summary table.
"""
from __future__ import annotations

import argparse
import json
import time
from collections import Counter

import requests

from h2o_vllm.config import request_keys
from h2o_devtools.models import TINY_CHAT_TEMPLATE
from h2o_devtools.soak import STOCK_PLUGINS
from h2o_devtools.server import results_subdir, run_header, served_model, start_server, stop_server

OPERATIONS = ["/v1/completions", "/v1/chat/completions", "/v1/responses"]
COMMON = ["--dtype", "float32", "--max-model-len", "1024", "--enforce-eager", "--block-size", "32",
          "--seed", "0", "--chat-template", TINY_CHAT_TEMPLATE]
#: A completions case without a prompt gets this one: else every such case is the same 400.
PROMPT = "Free software is a matter of liberty, not price"
SIDES = {"h2o": ["--kv-eviction", "h2o", "--h2o-heavy-tokens", "8", "--h2o-recent-tokens", "8"],
         "stock": []}
#: The stock side loads no plugin at all (vLLM loads only the general plugins named here).
STOCK_ENV = {"VLLM_PLUGINS": STOCK_PLUGINS}
MISSPELT = "h2o_heavy_tokns"


def xargs_strategy():
    """H2O keys (and one misspelt) with any JSON value (finite floats: the client must send it);
    another plugin's key beside them."""
    from hypothesis import strategies as st
    values = st.one_of(st.none(), st.booleans(), st.integers(-10, 5000),
                       st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=6))
    keys = st.sampled_from(sorted(request_keys()) + [MISSPELT, "other_plugin_key"])
    return st.dictionaries(keys, values, max_size=3)


def cases(operation, examples: int, with_xargs: bool) -> list:
    """``examples`` cases of ``operation``, the same ones on every run (derandomized)."""
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import strategies as st
    drawn = []
    strategy = operation.as_strategy()
    if with_xargs:
        strategy = st.tuples(strategy, xargs_strategy()).map(_with_xargs)

    @settings(max_examples=examples, derandomize=True, deadline=None, database=None,
              phases=[Phase.generate], suppress_health_check=list(HealthCheck))
    @given(strategy)
    def collect(case):
        drawn.append(case)
    collect()
    return drawn


def _with_xargs(pair):
    case, xargs = pair
    if isinstance(case.body, dict):
        case.body = {**case.body, "vllm_xargs": xargs}
    return case


def fuzz_side(url: str, examples: int) -> dict:
    """Every case of every operation against ``url``, its ``model`` field set to the served
    model (else nearly every case is only a 404 for an unknown model)."""
    import schemathesis
    schema = schemathesis.openapi.from_url(f"{url}/openapi.json", timeout=120)
    model = requests.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"]
    results = {}
    for path in OPERATIONS:
        operation = schema[path]["POST"]
        for with_xargs in (False, True):
            label = f"POST {path}" + (" +vllm_xargs" if with_xargs else "")
            statuses, errors, reasons = [], [], Counter()
            for i, case in enumerate(cases(operation, examples, with_xargs)):
                if isinstance(case.body, dict):
                    case.body = {**case.body, "model": model}
                    if path == "/v1/completions" and not case.body.get("prompt"):
                        case.body["prompt"] = PROMPT
                try:
                    response = case.call(base_url=url, timeout=120)
                    statuses.append(response.status_code)
                    if 400 <= response.status_code < 500:
                        reasons[_reason(response)] += 1
                    if response.status_code >= 500:
                        errors.append({"case": i, "status": response.status_code, "body": case.body,
                                       "response": response.text[:400]})
                except requests.RequestException as exc:  # a dropped connection counts as a failure
                    statuses.append(0)
                    errors.append({"case": i, "status": 0, "body": case.body, "response": repr(exc)[:400]})
            results[label] = {"statuses": statuses, "errors": errors, "4xx_reasons": reasons.most_common()}
    return results


def _reason(response) -> str:
    """A 4xx's message, cut before the values it quotes (so equal reasons count together)."""
    try:
        message = str(response.json().get("error", {}).get("message", response.text))
    except ValueError:
        message = response.text
    return message.split(":")[0].split("(")[0][:80]


def idle(url: str) -> dict:
    """Health and pool state once the fuzzing stopped (live KV tokens: H2O side only)."""
    time.sleep(2)
    health = requests.get(f"{url}/health", timeout=10).status_code
    usage, live = [], None
    for line in requests.get(f"{url}/metrics", timeout=10).text.splitlines():
        if line.startswith("vllm:kv_cache_usage_perc"):
            usage.append(float(line.rsplit(" ", 1)[1]))
        if line.startswith("h2o_vllm:live_kv_tokens "):
            live = float(line.rsplit(" ", 1)[1])
    return {"health": health, "kv_cache_usage": usage, "live_kv_tokens": live}


def summary(report: dict) -> str:
    def classes(statuses):
        counts = Counter("5xx" if s >= 500 else "dropped" if s == 0 else f"{s // 100}xx" for s in statuses)
        return ", ".join(f"{k} {v}" for k, v in sorted(counts.items()))
    rows = ["| operation | cases | H2O: statuses | stock: statuses | 5xx H2O / stock |", "|---|---|---|---|---|"]
    sides = report["sides"]
    for label in sides["h2o"]["results"]:
        h2o, stock = sides["h2o"]["results"][label], sides["stock"]["results"][label]
        rows.append(f"| `{label}` | {len(h2o['statuses'])} | {classes(h2o['statuses'])} | "
                    f"{classes(stock['statuses'])} | {len(h2o['errors'])} / {len(stock['errors'])} |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="HF model directory (default: a tiny random Llama)")
    p.add_argument("--smollm2", action="store_true", help="the offline SmolLM2-135M-Instruct instead")
    p.add_argument("--examples", type=int, default=40, help="cases per operation and mode")
    p.add_argument("--out", default=None, help="output directory")
    args = p.parse_args(argv)
    model_dir, name = served_model(args.model, not args.smollm2, "h2o-fuzz-")
    out = results_subdir(args.out, __file__, "fuzz")
    report = {**run_header(__file__, argv), "model": name, "examples": args.examples, "sides": {}}
    for side, flags in SIDES.items():
        proc, url = start_server(model_dir, [*COMMON, *flags], out / "logs" / f"{side}.log",
                                 env=STOCK_ENV if side == "stock" else None)
        try:
            started = time.monotonic()
            results = fuzz_side(url, args.examples)
            report["sides"][side] = {"flags": flags, "results": results, "after": idle(url),
                                     "seconds": round(time.monotonic() - started, 1)}
        finally:
            stop_server(proc)
    h2o_only = {label: sorted({e["status"] for e in r["errors"]}) for label, r in report["sides"]["h2o"]["results"].items()
                if len(r["errors"]) > len(report["sides"]["stock"]["results"][label]["errors"])}
    report["h2o_only_5xx"] = h2o_only
    (out / "fuzz.json").write_text(json.dumps(report, indent=1, default=str))
    print(summary(report))
    print({side: report["sides"][side]["after"] for side in report["sides"]}, "H2O-only 5xx:", h2o_only)


if __name__ == "__main__":
    main()
