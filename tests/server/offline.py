"""Offline reference answers for the server tests: `python offline.py SPEC.json OUT.json`.

SPEC: {"model": dir, "llm": {LLM kwargs}, "completions": [{"prompt": str, "max_tokens": int,
"extra_args": {...}}], "chats": [{"messages": [...], "max_tokens": int, "extra_args": {...}}],
"chat_template": str | null}. OUT: {"completions": [[token ids]], "chats": [[token ids]]}.
Greedy, ignore_eos, like the server requests the tests send.
"""
import json
import sys

from vllm import LLM, SamplingParams


def _params(request: dict) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=request["max_tokens"], ignore_eos=True,
                          extra_args=request.get("extra_args") or None)


def main(spec_path: str, out_path: str) -> None:
    with open(spec_path) as f:
        spec = json.load(f)
    llm = LLM(spec["model"], **spec["llm"])
    out = {"completions": [], "chats": []}
    completions = spec.get("completions", [])
    if completions:
        results = llm.generate([r["prompt"] for r in completions], [_params(r) for r in completions],
                               use_tqdm=False)
        out["completions"] = [list(r.outputs[0].token_ids) for r in results]
    for request in spec.get("chats", []):
        result = llm.chat(request["messages"], _params(request), use_tqdm=False,
                          chat_template=spec.get("chat_template"))
        out["chats"].append(list(result[0].outputs[0].token_ids))
    with open(out_path, "w") as f:
        json.dump(out, f)


if __name__ == "__main__":
    main(*sys.argv[1:3])
