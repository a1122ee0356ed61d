"""A draft model's acceptance under an H2O target, with the drafter's own KV cache whole (what
h2o-vllm runs) or evicted by H2O with a budget of its own (not built): measured on the dense
oracle, not in vLLM.

The engine leaves a drafter's cache whole (docs/semantics.md, "Speculative decoding"); this
measures what evicting it too would do to acceptance, before building it. Greedy speculative
decoding is replayed on ``h2o_vllm.oracle.H2OOracle``: the target's tokens are the oracle's
at ``--target-budget``; after each verification the drafter, from its state over the accepted
tokens, proposes ``--drafts`` tokens greedily (on a copy of its state); the longest prefix
matching the target's tokens is accepted, and the drafter then consumes the accepted tokens and
the target's bonus token, one step each, so its H2O cadence runs per token. A rejected draft
leaves nothing in the drafter's state (the ideal an engine would have to reach). The drafter
is the target model itself unless ``--drafter`` names another with the same tokenizer, or
``--drafter-layers`` keeps some of the target's layers (layer-skipping self-speculation).

One JSON, one Markdown table and one PNG into
``benchmarks/results/<date>-<host>/drafter-eviction/``.

    python benchmarks/drafter_eviction.py                    # SmolLM2 drafting for itself
    python benchmarks/drafter_eviction.py --num-prompts 1 --output-len 16   # a quick look
"""
from __future__ import annotations

import argparse
import copy
import datetime
import json
import socket
import sys
import time
from pathlib import Path


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="HF model directory, or smollm2 (default) | gemma3-270m")
    p.add_argument("--drafter", default=None, help="the draft model (default: the target model itself)")
    p.add_argument("--drafter-layers", default=None,
                   help="a layer-skipping drafter: these of the target's layers only, e.g. 0-9,20-29")
    p.add_argument("--target-budget", type=float, default=0.2,
                   help="the target's H2O budget, a fraction of the prompt (heavy = recent = half)")
    p.add_argument("--drafter-budgets", default="whole,0.5,0.2,0.1",
                   help="comma list: whole (the drafter's cache kept whole) or a fraction as above")
    p.add_argument("--drafts", type=int, default=3, help="draft tokens per verification (k)")
    p.add_argument("--block-size", type=int, default=16, help="the KV block: each H2O interval")
    p.add_argument("--text", default="gpl3", help="a name of h2o_devtools.bench.TEXTS or a file")
    p.add_argument("--num-prompts", type=int, default=4)
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--out", default=None,
                   help="output directory (default benchmarks/results/<date>-<host>/drafter-eviction)")
    return p.parse_args(argv)


def replay(drafter, prompt: list[int], target_tokens: list[int], k: int) -> tuple[int, int]:
    """(drafts, accepted) of greedy speculation against ``target_tokens`` (the first of which
    the target samples from the prompt, before any draft)."""
    state = drafter.new_state(len(prompt))
    drafter.prefill(state, prompt)
    logits = drafter.step(state, target_tokens[:1])
    pos, drafts, accepted = 1, 0, 0
    while pos < len(target_tokens):
        trial, trial_logits, proposal = copy.deepcopy(state), logits, []
        num_drafts = min(k, len(target_tokens) - pos)
        for i in range(num_drafts):
            proposal.append(int(trial_logits.argmax()))
            if i + 1 < num_drafts:
                trial_logits = drafter.step(trial, proposal[-1:])
        matched = next((i for i, (d, t) in enumerate(zip(proposal, target_tokens[pos:])) if d != t), len(proposal))
        drafts, accepted = drafts + len(proposal), accepted + matched
        for token in target_tokens[pos:pos + matched + 1]:
            logits = drafter.step(state, [token])
        pos += matched + 1
    return drafts, accepted


def parse_layers(text: str) -> list[int]:
    """"0-9,20-29" -> [0, ..., 9, 20, ..., 29]."""
    layers = []
    for part in text.split(","):
        first, _, last = part.partition("-")
        layers.extend(range(int(first), int(last or first) + 1))
    return layers


def layer_subset(model, layers: list[int]):
    """A copy of an HF decoder-only model with only ``layers``, renumbered for its KV cache."""
    import torch
    subset = copy.deepcopy(model)
    subset.model.layers = torch.nn.ModuleList(subset.model.layers[i] for i in layers)
    for index, layer in enumerate(subset.model.layers):
        layer.self_attn.layer_idx = index
    config = subset.config
    if getattr(config, "layer_types", None):
        config.layer_types = [config.layer_types[i] for i in layers]
    config.num_hidden_layers = len(layers)
    return subset


def main(argv=None) -> dict:
    args = parse_args(argv)
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from h2o_devtools import bench, models
    from h2o_vllm.config import H2OConfig
    from h2o_vllm.oracle import H2OOracle

    def config(budget: str | float):
        return None if budget == "whole" else H2OConfig.from_dict(bench.h2o_config("h2o", float(budget)))

    model_dir = models.model_dir(args.model)
    drafter_dir = models.model_dir(args.drafter) if args.drafter else model_dir
    out = bench.results_dir(args.out or str(Path(__file__).parent / "results" /
                                             f"{datetime.date.today()}-{socket.gethostname()}" / "drafter-eviction"),
                            __file__)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompts = bench.text_prompts(tokenizer(bench.read_text(args.text)).input_ids, args.num_prompts, args.prompt_len)
    target = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    drafter_model = target if drafter_dir == model_dir else \
        AutoModelForCausalLM.from_pretrained(drafter_dir, dtype=torch.float32).eval()
    if args.drafter_layers:
        drafter_model = layer_subset(drafter_model, parse_layers(args.drafter_layers))
    target_tokens = H2OOracle(target, config(args.target_budget), block_size=args.block_size).generate(
        prompts, args.output_len)
    rows = []
    for budget in args.drafter_budgets.split(","):
        started = time.perf_counter()
        drafter = H2OOracle(drafter_model, config(budget), block_size=args.block_size)
        counts = [replay(drafter, p, t, args.drafts) for p, t in zip(prompts, target_tokens)]
        drafts, accepted = sum(c[0] for c in counts), sum(c[1] for c in counts)
        rows.append({"drafter_budget": budget, "drafts": drafts, "accepted": accepted,
                     "acceptance": accepted / drafts if drafts else None,
                     "per_prompt": [{"drafts": d, "accepted": a} for d, a in counts],
                     "seconds": round(time.perf_counter() - started, 1)})
        print(f"drafter {budget}: {accepted}/{drafts} accepted", file=sys.stderr)
    result = {"meta": {"date": datetime.datetime.now().isoformat(timespec="seconds"),
                       "command": " ".join([sys.executable, __file__, *(sys.argv[1:] if argv is None else argv)]),
                       "model": str(model_dir), "drafter": str(drafter_dir), "drafter_layers": args.drafter_layers,
                       "target_budget": args.target_budget,
                       "drafts_per_step": args.drafts, "block_size": args.block_size, "text": args.text,
                       "num_prompts": args.num_prompts, "prompt_len": args.prompt_len,
                       "output_len": args.output_len,
                       "measured_on": "the dense oracle (h2o_vllm.oracle), not vLLM: a replay of greedy "
                                      "speculation; rejected drafts leave nothing in the drafter's state"},
              "rows": rows}
    (out / "drafter_eviction.json").write_text(json.dumps(result, indent=2))
    write_table(result, out / "drafter_eviction.md")
    write_plot(result, out / "drafter_eviction.png")
    print(out)
    return result


def _cache_name(row: dict) -> str:
    budget = row["drafter_budget"]
    return "whole" if budget == "whole" else f"H2O {float(budget):.0%}"


def write_table(result: dict, path: Path) -> None:
    meta = result["meta"]
    drafter = "the target itself" if meta["drafter"] == meta["model"] else meta["drafter"]
    if meta.get("drafter_layers"):
        drafter = f"the target's layers {meta['drafter_layers']}"
    lines = [f"Drafter: {drafter}. Target H2O {meta['target_budget']:.0%}, {meta['drafts_per_step']} drafts a step, "
             f"{meta['num_prompts']} x {meta['prompt_len']}-token {meta['text']} windows, "
             f"{meta['output_len']} tokens each; measured on {meta['measured_on']}.", "",
             "| drafter KV cache | drafts | accepted | acceptance |", "|---|---:|---:|---:|"]
    for row in result["rows"]:
        lines.append(f"| {_cache_name(row)} | {row['drafts']} | {row['accepted']} | {row['acceptance']:.2f} |")
    path.write_text("\n".join(lines) + "\n")


def write_plot(result: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = result["rows"]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.bar([_cache_name(r) for r in rows], [r["acceptance"] for r in rows], color="tab:blue")
    ax.set_ylim(0, 1)
    ax.set_xlabel("drafter's KV cache")
    ax.set_ylabel("draft tokens accepted")
    ax.set_title(f"Drafter under an H2O {result['meta']['target_budget']:.0%} target (oracle replay)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
