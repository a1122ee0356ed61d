"""`make demo`: real vLLM on SmolLM2-135M-Instruct, full KV cache vs H2O at a 20% budget.

``python -m h2o_devtools.demo --help`` for the budget, policy and lengths (a dev tool of the
checkout, not part of the installed ``h2o-vllm`` command).

The prompts are a few hundred tokens long, so that 20% of one is a real cache (a 5-token
prompt keeps 1 token). H2O runs the recommended score mode (``RECOMMENDED``, from docs/results.md's
quality table; ``--policy h2o`` for the paper's). Prints the greedy answers side by side and
the KV blocks each run held, as the engine's own scheduler counted them. Runs the engine core
in-process so its block pool can be read.
"""
from __future__ import annotations

import argparse
import os
import textwrap

# Plain completion prompts (SmolLM2's chat template alone is ~30 tokens of system prompt).
PROMPTS = [
    "{gpl}\n\nIn short, this licence says that",
    "The secret pass key is 482913. Remember it, you will be asked for it.\n\n{gpl}\n\n"
    "What is the secret pass key? The secret pass key is",
    "{gpl}\n\nThe three freedoms this licence protects are",
]
#: The policy shown beside the full cache (h2o_devtools.bench: "h2o" or a score mode).
RECOMMENDED = "window+pool"


def _gpl_excerpt(words: int = 350) -> str:
    try:
        with open("/usr/share/common-licenses/GPL-3") as f:
            return " ".join(f.read().split()[:words])
    except OSError:
        return "Free software is software that respects users' freedom. " * 40


def _run(model_dir: str, prompts: list[str], max_tokens: int, block_size: int, h2o: dict | None):
    from vllm import LLM, SamplingParams

    kwargs = {"additional_config": {"h2o": h2o}} if h2o is not None else {}
    from h2o_vllm.vllm_shims import introspect

    llm = LLM(model_dir, dtype="float32", max_model_len=2048, block_size=block_size,
              enforce_eager=True, enable_prefix_caching=False, seed=0, **kwargs)
    engine = llm.llm_engine
    pool = introspect.block_pool(introspect.in_process_scheduler(engine))
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    free = pool.get_num_free_blocks()
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, params)
    texts, peak, block_steps, steps = {}, 0, 0, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                texts[int(out.request_id)] = out.outputs[0].text
        used = free - pool.get_num_free_blocks()
        peak, block_steps, steps = max(peak, used), block_steps + used, steps + 1
    engine.engine_core.shutdown()
    return [texts[i] for i in range(len(prompts))], peak, block_steps / max(steps, 1)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m h2o_devtools.demo", description=__doc__)
    parser.add_argument("--budget", type=float, default=0.2, help="total budget, fraction of the prompt")
    parser.add_argument("--policy", default=RECOMMENDED, help="h2o (the paper's) or a score mode of "
                        "h2o_devtools.bench.MODES")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--block-size", type=int, default=16)
    args = parser.parse_args(argv)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    # In-process engine core: the demo reads the scheduler's block pool directly.
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"

    from h2o_devtools.bench import h2o_config
    from h2o_devtools.models import smollm2_dir
    model = str(smollm2_dir())
    prompts = [p.format(gpl=_gpl_excerpt()) for p in PROMPTS]
    h2o = h2o_config(args.policy, args.budget)
    full = _run(model, prompts, args.max_tokens, args.block_size, None)
    evicted = _run(model, prompts, args.max_tokens, args.block_size, h2o)

    budget = int(round(100 * args.budget))
    width = 60
    print(f"\nSmolLM2-135M-Instruct, greedy, {args.max_tokens} new tokens, block size {args.block_size}")
    print(f"{'full KV cache':<{width}} | H2O {budget}%, {args.policy}: {h2o}")
    for prompt, a, b in zip(prompts, full[0], evicted[0]):
        print("=" * (2 * width + 3))
        print("PROMPT:", textwrap.shorten(prompt, 2 * width))
        left = textwrap.wrap(a.strip(), width) or [""]
        right = textwrap.wrap(b.strip(), width) or [""]
        for i in range(max(len(left), len(right))):
            l = left[i] if i < len(left) else ""
            r = right[i] if i < len(right) else ""
            print(f"{l:<{width}} | {r}")
    print("=" * (2 * width + 3))
    print(f"KV blocks held (engine's block pool): full cache peak {full[1]}, mean {full[2]:.1f}; "
          f"H2O {budget}% peak {evicted[1]}, mean {evicted[2]:.1f}")


if __name__ == "__main__":
    main()
