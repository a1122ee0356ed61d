"""Disaggregated prefill/decode (issue 40): a P/D pair against one engine at equal total KV
memory, long prompts and short answers, stock vLLM and H2O 20%.

    python benchmarks/pd_transfer.py                       # SmolLM2, 32 x 1,000-token GPL-3 prompts, 32 out
    python benchmarks/pd_transfer.py --model DIR --num-requests 4 --prompt-len 200 --output-len 8
    python benchmarks/pd_transfer.py --connector nixl       # the same over vLLM's NixlConnector settings

Per system (stock: vLLM's own ``ExampleConnector`` with the plugin off; h2o: the same settings,
which H2O runs as ``H2OStorageConnector``), each engine a fresh process (``--one``):

- single: one engine with ``2 * --num-blocks`` KV blocks serves every request whole;
- pair: a producer (``kv_producer``, ``--num-blocks``) prefills each prompt with one output token
  (as vLLM's P/D examples run it), then a consumer (``kv_consumer``, ``--num-blocks``) is given
  prompt + that token and decodes the rest.

Measured: bytes the producer stored per request (the storage folder, what a network would
carry), TTFT (single: its own; pair: the producer's), the prefill and decode phases, output
tok/s and requests/s of the pair run one phase after the other, and pipelined (P and D on
machines of their own, each phase overlapping the other's next batch: requests / the longer
phase), the consumer's running sequences and KV blocks per running sequence. Every engine runs
one OpenMP thread and reserves the connector's core alike (``VLLM_CPU_NUM_OF_RESERVED_CPU``).
The pair's tokens are checked against the single engine's. Writes ``pd_transfer.json``,
``pd_transfer.md`` and ``pd_transfer.png`` to ``--out``; the storage folders are temporary.

``--connector nixl``: both engines ``kv_both`` on vLLM's ``NixlConnector`` settings (stock:
vLLM's NIXL connector, the decoder reads the prompt's blocks; h2o: H2O's, it reads the packed
kept state), as vLLM's disaggregation proxy drives them: the producer prefills with
``do_remote_decode`` and stays up while the consumer gets the original prompts with the
producer's ``kv_transfer_params``. Bytes per request are what the decoder reads: the blocks
named in stock's params times a block's K/V bytes, the ``nbytes`` named in H2O's. The producer
holds every prompt until the decoder reads it (stock: its KV blocks, which vLLM's NIXL
connector keeps until read; H2O: its staging memory, its blocks free at once), so run one
phase after the other its pool fits all of them, both systems alike, and leases outlast the
run; the decoder's pool is ``--num-blocks`` as for the storage pair.
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

from h2o_devtools import bench

SYSTEMS = ("stock", "h2o")
RATIO = 0.1  # heavy and recent each: H2O 20%


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--one", default=None, help=argparse.SUPPRESS)  # internal: one engine's run
    p.add_argument("--model", default=None, help="HF model directory, or smollm2 (default)")
    p.add_argument("--num-requests", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=1000)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--block-size", type=int, default=32, help="stock CPU attention needs a multiple of 32")
    p.add_argument("--num-blocks", type=int, default=80, help="KV blocks of each P/D engine; the single engine has twice")
    p.add_argument("--text", default="gpl3")
    p.add_argument("--connector", choices=("example", "nixl"), default="example",
                   help="vLLM's ExampleConnector (shared storage) or NixlConnector settings")
    p.add_argument("--omp-threads", default="1")
    p.add_argument("--out", default=None, help="default benchmarks/results/<date>-<host>/pd-transfer")
    return p.parse_args(argv)


def run_one(job: dict) -> dict:
    """In a fresh process: one engine (``job["role"]``: single, producer or consumer) over its prompts."""
    from vllm import LLM, SamplingParams
    llm_kwargs = dict(dtype="float32", block_size=job["block_size"], num_gpu_blocks_override=job["num_blocks"],
                      max_model_len=job["max_model_len"], enforce_eager=True, enable_prefix_caching=False,
                      disable_log_stats=False, seed=0)
    if job["system"] == "h2o":
        llm_kwargs["additional_config"] = {"h2o": {"heavy_ratio": RATIO, "recent_ratio": RATIO}}
    nixl = job.get("connector") == "nixl"
    if job["role"] != "single" and nixl:
        llm_kwargs["kv_transfer_config"] = {"kv_connector": "NixlConnector", "kv_role": "kv_both",
                                            "kv_buffer_device": "cpu",
                                            "kv_connector_extra_config": {"h2o_staging_mib": job["staging_mib"],
                                                                          "kv_lease_duration": 3600}}
    elif job["role"] != "single":
        llm_kwargs["kv_transfer_config"] = {
            "kv_connector": "ExampleConnector", "kv_role": f"kv_{job['role']}",
            "kv_connector_extra_config": {"shared_storage_path": job["store"]}}
    llm = LLM(job["model"], **llm_kwargs)

    def sampling(kv_params=None):
        extra = {"kv_transfer_params": kv_params} if kv_params is not None else None
        return SamplingParams(temperature=0.0, max_tokens=job["max_tokens"], ignore_eos=True, extra_args=extra)
    if nixl and job["role"] == "producer":
        params = sampling({"do_remote_decode": True, "do_remote_prefill": False})
    elif nixl and job["role"] == "consumer":
        params = [sampling(kv) for kv in job["kv_params"]]
    else:
        params = sampling()
    outputs, kv_params = {}, {}
    original_step = llm.llm_engine.step

    def step():  # keep each request's tokens (measure counts them only)
        outs = original_step()
        for out in outs:
            if out.finished:
                outputs[int(out.request_id.removeprefix("bench-"))] = list(out.outputs[0].token_ids)
                kv_params[int(out.request_id.removeprefix("bench-"))] = out.kv_transfer_params
        return outs
    llm.llm_engine.step = step
    stats = bench.measure(llm, job["prompts"], params)
    summary = stats.summary()
    summary["blocks_per_running"] = (sum(b / r for b, r in zip(stats.blocks_used, stats.running) if r)
                                     / max(1, sum(1 for r in stats.running if r)))
    summary["outputs"] = [outputs[i] for i in range(len(job["prompts"]))]
    summary["kv_params"] = [kv_params[i] for i in range(len(job["prompts"]))]
    if job.get("hold"):  # a NIXL producer serves its memory until the consumer is done
        Path(job["result"]).write_text(json.dumps(summary))
        while not Path(job["hold"]).exists():
            time.sleep(0.5)
    return summary


def _store_bytes(store: Path) -> int:
    return sum(p.stat().st_size for p in store.rglob("*") if p.is_file())


def run_system(args, system: str, prompts: list[list[int]], out: Path) -> dict:
    env = bench.engine_env(args.omp_threads)
    env["VLLM_CPU_NUM_OF_RESERVED_CPU"] = "1"  # a connector reserves one; the single engine alike
    if system == "stock":
        from h2o_devtools.soak import STOCK_PLUGINS
        env["VLLM_PLUGINS"] = STOCK_PLUGINS
    common = dict(model=args.model, system=system, block_size=args.block_size,
                  max_model_len=args.prompt_len + args.output_len + 1)

    def child(role: str, **job) -> dict:
        job = dict(common, role=role, result=str(out / "logs" / f"{system}-{role}.result.json"), **job)
        return bench.run_child(__file__, job, out / "logs" / f"{system}-{role}", env, f"{system} {role}")

    single = child("single", num_blocks=2 * args.num_blocks, prompts=prompts, max_tokens=args.output_len)
    if args.connector == "nixl":
        producer, consumer, moved = _nixl_pair(args, system, prompts, out, common, env)
        pair_outputs = consumer["outputs"]  # the decoder's answer is the whole answer
        return _summary(args, system, moved, single, producer, consumer, pair_outputs)
    store = Path(tempfile.mkdtemp(prefix=f"pd-{system}-"))  # never inside the repository
    try:
        producer = child("producer", num_blocks=args.num_blocks, prompts=prompts, max_tokens=1, store=str(store))
        stored = _store_bytes(store)
        continued = [p + o for p, o in zip(prompts, producer["outputs"])]
        consumer = child("consumer", num_blocks=args.num_blocks, prompts=continued,
                         max_tokens=args.output_len - 1, store=str(store))
    finally:
        shutil.rmtree(store, ignore_errors=True)
    pair_outputs = [p + c for p, c in zip(producer["outputs"], consumer["outputs"])]
    return _summary(args, system, stored, single, producer, consumer, pair_outputs)


def _nixl_pair(args, system: str, prompts, out: Path, common: dict, env: dict) -> tuple[dict, dict, int]:
    """The producer up (its own side-channel port, as two engines on one host need) while the
    consumer decodes from its params; returns both runs and the bytes the decoder read."""
    from transformers import AutoConfig
    config = AutoConfig.from_pretrained(args.model)
    head_size = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    block_bytes = config.num_hidden_layers * 2 * args.block_size * config.num_key_value_heads * head_size * 4
    holds_all = len(prompts) * -(-(args.prompt_len + 1) // args.block_size) + 8
    jobs = {}
    for port, role, blocks in ((5610, "producer", max(args.num_blocks, holds_all)), (5620, "consumer", args.num_blocks)):
        stem = out / "logs" / f"{system}-nixl-{role}"
        jobs[role] = (stem, dict(common, role=role, connector="nixl", num_blocks=blocks,
                                 staging_mib=1024, result=f"{stem}.result.json"),
                      dict(env, VLLM_NIXL_SIDE_CHANNEL_PORT=str(port)))
    stem, job, penv = jobs["producer"]
    hold = Path(f"{stem}.hold")
    hold.unlink(missing_ok=True)
    proc = bench.spawn_child(__file__, dict(job, prompts=prompts, max_tokens=1, hold=str(hold)), stem, penv)
    try:
        while not Path(job["result"]).exists():
            if proc.poll() is not None:
                raise RuntimeError(f"{system} nixl producer failed (exit {proc.returncode}); see {stem}.log")
            time.sleep(1)
        time.sleep(1)  # written whole
        producer = bench.child_result(job, stem, f"{system} nixl producer", None)
        cstem, cjob, cenv = jobs["consumer"]
        consumer = bench.run_child(__file__, dict(cjob, prompts=prompts, max_tokens=args.output_len,
                                                  kv_params=producer["kv_params"]), cstem, cenv,
                                   f"{system} nixl consumer")
    finally:
        hold.touch()
        proc.wait(timeout=120)
        hold.unlink(missing_ok=True)
        Path(job["result"]).unlink(missing_ok=True)  # written again as it exits
    moved = sum(kv["h2o_nixl"]["nbytes"] if "h2o_nixl" in kv
                else sum(map(len, kv["remote_block_ids"])) * block_bytes for kv in producer["kv_params"])
    return producer, consumer, moved


def _summary(args, system: str, moved: int, single: dict, producer: dict, consumer: dict, pair_outputs) -> dict:
    n, outputs = len(pair_outputs), args.output_len * len(pair_outputs)
    prefill, decode = producer["elapsed_s"], consumer["elapsed_s"]
    return {
        "system": system,
        "bytes_per_request": moved / n,
        "single": _public(single),
        "producer": _public(producer),
        "consumer": _public(consumer),
        "pair": {"mean_ttft_s": producer["mean_ttft_s"], "median_ttft_s": producer["median_ttft_s"],
                 "prefill_s": prefill, "decode_s": decode,
                 "output_tok_s": outputs / (prefill + decode), "requests_s": n / (prefill + decode),
                 "pipelined_requests_s": n / max(prefill, decode),
                 "same_tokens_as_single": pair_outputs == single["outputs"],
                 "same_tokens": sum(a == b for a, b in zip(pair_outputs, single["outputs"]))},
    }


def _public(run: dict) -> dict:
    return {k: v for k, v in run.items() if k not in ("outputs", "kv_params")}


def table(result: dict) -> str:
    rows = [("bytes stored / read per request (MiB)", lambda r: f"{r['bytes_per_request'] / 2**20:.2f}"),
            ("TTFT mean, single / pair (s)", lambda r: f"{r['single']['mean_ttft_s']:.1f} / {r['pair']['mean_ttft_s']:.1f}"),
            ("prefill phase / decode phase (s)", lambda r: f"{r['pair']['prefill_s']:.1f} / {r['pair']['decode_s']:.1f}"),
            ("decoder peak running / KV blocks per running sequence",
             lambda r: f"{r['consumer']['peak_running']} / {r['consumer']['blocks_per_running']:.1f}"),
            ("output tok/s, single / pair", lambda r: f"{r['single']['output_tok_s']:.1f} / {r['pair']['output_tok_s']:.1f}"),
            ("requests/s, single / pair / pair pipelined",
             lambda r: f"{r['single']['requests_s']:.3f} / {r['pair']['requests_s']:.3f} / {r['pair']['pipelined_requests_s']:.3f}"),
            ("pair's tokens = single engine's", lambda r: f"{r['pair']['same_tokens']}/{r['single']['num_requests']}")]
    runs = result["runs"]
    lines = ["| | " + " | ".join(r["system"] for r in runs) + " |", "|---" * (len(runs) + 1) + "|"]
    lines += [f"| {name} | " + " | ".join(cell(r) for r in runs) + " |" for name, cell in rows]
    return "\n".join(lines) + "\n"


def plot(result: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    runs = result["runs"]
    panels = [("MiB stored per request", lambda r: [r["bytes_per_request"] / 2**20]),
              ("mean TTFT (s): single, pair", lambda r: [r["single"]["mean_ttft_s"], r["pair"]["mean_ttft_s"]]),
              ("output tok/s: single, pair", lambda r: [r["single"]["output_tok_s"], r["pair"]["output_tok_s"]]),
              ("req/s: single, pair, pipelined", lambda r: [r["single"]["requests_s"], r["pair"]["requests_s"],
                                                            r["pair"]["pipelined_requests_s"]])]
    fig, axes = plt.subplots(1, len(panels), figsize=(4 * len(panels), 3.2))
    for ax, (title, values) in zip(axes, panels):
        width = 0.8 / len(runs)
        for k, run in enumerate(runs):
            ys = values(run)
            ax.bar([x + k * width for x in range(len(ys))], ys, width, label=run["system"])
        ax.set_title(title, fontsize=9)
        ax.set_xticks([])
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.one:
        bench.run_job_file(args.one, run_one)
        return {}
    from transformers import AutoTokenizer

    from h2o_devtools import models
    args.model = str(models.model_dir(args.model))
    folder = "pd-transfer" if args.connector == "example" else "pd-transfer-nixl"
    out = bench.results_dir(args.out, __file__) if args.out else bench.results_dir(None, __file__) / folder
    (out / "logs").mkdir(parents=True, exist_ok=True)
    ids = AutoTokenizer.from_pretrained(args.model)(bench.read_text(args.text)).input_ids
    prompts = bench.text_prompts(ids, args.num_requests, args.prompt_len)
    result = {"meta": {k: v for k, v in vars(args).items() if k != "one"},
              "command": "python benchmarks/pd_transfer.py " + " ".join(sys.argv[1:] if argv is None else argv),
              "runs": [run_system(args, system, prompts, out) for system in SYSTEMS]}
    (out / "pd_transfer.json").write_text(json.dumps(result, indent=2))
    (out / "pd_transfer.md").write_text(table(result))
    plot(result, out / "pd_transfer.png")
    print(table(result))
    return result


if __name__ == "__main__":
    main()
