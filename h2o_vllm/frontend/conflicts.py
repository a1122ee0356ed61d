"""Settings H2O cannot run with, refused before any model weight loads.

Called from the engine-args hook (``vllm_hooks.install_engine_args_hook``) only when H2O is on:
``check_engine_args`` on the raw ``EngineArgs`` before vLLM builds its config (the cheap
checks, so a refusal costs nothing), ``check_vllm_config`` on the built ``VllmConfig`` (the
model's attention, read from its HF config, and the resolved ``max_model_len`` / block size).
Each refusal is a ``ValueError`` that names the setting and the way out; docs/limits.md
("Conflicts: refused before the model loads") lists them with the reason for each.

Pure logic over vLLM config objects (duck-typed: unit tests pass stand-ins).
"""
from __future__ import annotations

from typing import Any

from h2o_vllm.config import MAX_PENDING, H2OConfig
from h2o_vllm.kv_transfer import transfer_config
from h2o_vllm.score_modes import Score
from h2o_vllm.score_modes.rotary import rotary_of

_OFF = "or turn H2O KV eviction off (drop --kv-eviction h2o / additional_config['h2o'])"


def check_engine_args(args: Any, h2o: H2OConfig) -> None:
    """Refuse settings visible on ``EngineArgs`` (``vllm serve`` flags, ``LLM(...)`` kwargs)."""
    _check_speculative_args(args)
    kv_transfer = getattr(args, "kv_transfer_config", None)
    if kv_transfer is not None:
        transfer_config.check(kv_transfer, way_out=_OFF)
    pp = getattr(args, "pipeline_parallel_size", 1) or 1
    if pp > 1:
        _refuse_pipeline_parallel(pp)


def check_vllm_config(vllm_config: Any, h2o: H2OConfig) -> None:
    """Refuse what only the built config shows: the model's attention, the resolved lengths,
    and settings vLLM derived itself (a speculator checkpoint sets ``speculative_config``)."""
    spec = getattr(vllm_config, "speculative_config", None)
    if spec is not None:
        method = getattr(spec, "method", None)
        check_speculative(method, getattr(spec, "num_speculative_tokens", None), "--speculative-config")
        _check_mtp_layers(method, getattr(spec, "draft_model_config", None))
        _check_device_ngram_runner(method, getattr(vllm_config, "use_v2_model_runner", False))
    kv_transfer = getattr(vllm_config, "kv_transfer_config", None)
    if kv_transfer is not None:
        transfer_config.check(kv_transfer, way_out=_OFF)
    parallel = getattr(vllm_config, "parallel_config", None)
    pp = getattr(parallel, "pipeline_parallel_size", 1) if parallel is not None else 1
    if pp > 1:
        _refuse_pipeline_parallel(pp)
    _refuse_split_batches(parallel)
    model = getattr(vllm_config, "model_config", None)
    if model is not None:
        check_model(model)
        check_score(vllm_config, h2o.score)
        if kv_transfer is not None:
            transfer_config.check_model(model, SLIDING_LAYERS, way_out=_OFF)
        check_budget_fits(h2o, model.max_model_len, vllm_config.cache_config.block_size)


def check_model(model_config: Any) -> None:
    """Refuse models whose attention H2O's scores or compaction would get wrong.

    Read from the HF config through ``ModelConfig`` (nothing is loaded)."""
    name = getattr(model_config, "model", "this model")

    def refuse(what: str, why: str, way_out: str = "") -> None:
        out = f"{way_out}, or " if way_out else "Use a model with plain causal full attention, or "
        raise ValueError(f"{name}: {what} cannot be combined with H2O KV eviction: {why}. {out}"
                         f"turn H2O KV eviction off (drop --kv-eviction h2o / additional_config['h2o'])")

    if model_config.is_encoder_decoder:
        refuse("an encoder-decoder model", "H2O evicts from decoder self-attention only, and the "
               "cross-attention KV cache has no eviction rule")
    if model_config.is_attention_free:
        refuse("an attention-free model", "it has no KV cache to evict")
    if model_config.is_hybrid:
        refuse("a hybrid model (attention with Mamba / linear-attention layers)",
               "H2O manages one full-attention KV-cache group")
    if model_config.use_mla:
        refuse("multi-head latent attention (MLA)", "H2O scores and compacts per KV head, and MLA "
               "caches one compressed latent per token")
    if model_config.uses_alibi:
        refuse("ALiBi position bias", "the bias follows the KV slot index, which compaction "
               "changes, and H2O's scores leave the bias out")
    hf = model_config.hf_text_config
    layer_types = getattr(hf, "layer_types", None) or ()
    odd_layers = sorted({t for t in layer_types if t not in FULL_LAYERS + SLIDING_LAYERS})
    if odd_layers:
        refuse(f"layer_types {odd_layers}", "H2O evicts from full-attention layers and leaves "
               "sliding-window layers to vLLM's window; layers of another kind are not supported")


def check_score(vllm_config: Any, score: str | None, key: str = "h2o.score") -> None:
    """Refuse a key scorer that reads queries (``Scorer.query_window``: Expected Attention) where
    it cannot run as its rule says: a RoPE it cannot move ahead (``score_modes.rotary``), or a
    step too small for its query window (``policy.window_step_limit`` would never schedule it)."""
    scorer = Score(score).key_scorer() if score is not None else None
    if scorer is None or not scorer.query_window:
        return
    rotary_of(vllm_config.model_config.hf_text_config, key)
    scheduler = getattr(vllm_config, "scheduler_config", None)
    step = getattr(scheduler, "max_num_batched_tokens", None)
    if step is not None and step < scorer.query_window:
        raise ValueError(f"{key} {score!r} reads the last {scorer.query_window} queries of the step that "
                         f"compacts, which must run in one step; --max-num-batched-tokens is {step}: raise "
                         f"it to {scorer.query_window} or more, or choose another {key} ('h2o' or 'keydiff')")


#: HF ``layer_types`` names of the layers H2O evicts from, and of those it leaves to vLLM's window.
FULL_LAYERS = ("attention", "full_attention")
SLIDING_LAYERS = ("sliding_attention",)


def has_full_attention(model_config: Any) -> bool:
    """Whether the model has a full-attention layer for H2O to evict from: a hybrid model
    (Gemma 2/3: sliding-window and full-attention layers) has; a model whose every layer slides
    (``sliding_window`` without ``layer_types``, e.g. Mistral 7B v0.1) has not."""
    layer_types = getattr(model_config.hf_text_config, "layer_types", None)
    if layer_types:
        return any(t in FULL_LAYERS for t in layer_types)
    return not model_config.get_sliding_window()


def nothing_to_evict_warning(model_config: Any) -> str:
    window = model_config.get_sliding_window()
    return (f"{getattr(model_config, 'model', 'this model')}: every attention layer uses a sliding "
            f"window (sliding_window={window}), which vLLM already bounds: H2O has nothing to evict "
            "and stays off. Pass --disable-sliding-window to run full attention with H2O instead "
            "(vLLM then caps max_model_len at the window).")


def check_budget_fits(h2o: H2OConfig, max_model_len: int, block_size: int) -> None:
    """Refuse an engine-wide budget under which no sequence can ever be evicted.

    The first compaction of a sequence happens once it holds ``max(prompt, budget +
    interval)`` tokens (``policy.live_kv_len``); the smallest budget is the one of a 1-token
    prompt. Per-request budgets may exceed it (a request then runs without eviction)."""
    budget = h2o.budget(1, block_size)
    needed = budget.tokens + budget.interval
    if needed <= max_model_len:
        return
    parts = " + ".join(f"{name}={value}" for name, value in (
        ("sinks", budget.sink_tokens), ("heavy", budget.heavy), ("recent", budget.recent),
        ("interval", budget.interval)) if value or name != "sinks")
    floor_note = (f" (recent includes the min_tokens floor of {h2o.floor_tokens()}: --h2o-min-tokens)"
                  if budget.recent > h2o.part_budget("recent", 1) else "")
    raise ValueError(
        f"the H2O budget does not fit max_model_len={max_model_len}: the first compaction needs "
        f"{parts} = {needed} tokens{floor_note}, so H2O would never evict. Lower "
        "h2o.heavy_tokens / h2o.recent_tokens / h2o.min_tokens / h2o.interval (--h2o-heavy-tokens, "
        f"...), raise --max-model-len, {_OFF}")


#: Speculators H2O runs with (docs/semantics.md, "Speculative decoding"): n-gram drafts come
#: from the token history and have no KV cache; a draft model's, an EAGLE head's and a model's
#: own MTP layers keep their KV cache whole, in KV-cache groups of their own
#: (``spec.h2o_specs``). vLLM names MTP layers "mtp" or by family ("mimo_mtp", ...);
#: "ngram_gpu" is the n-gram lookup run on the device (a worker-side drafter, so async
#: scheduling stays on with it).
SPECULATORS = ("ngram", "ngram_gpu", "draft_model", "eagle", "eagle3", "mtp")


def _speculator(method: str | None) -> str | None:
    """The speculator a method name asks for: every vLLM MTP family name is "mtp"."""
    return "mtp" if method is not None and method.endswith("_mtp") else method


#: MTP layers vLLM drafts with through a proposer of their own rather than its EAGLE one
#: (``gpu_model_runner``'s ``use_gemma4_mtp`` / ``use_step3p5_mtp``), and why H2O refuses them.
_OWN_PROPOSER_MTP = {
    "gemma4_mtp": "its MTP layers read the target's own KV cache (KV sharing), which H2O compacts",
    "step3p5_mtp": "its proposer builds attention metadata per KV-cache group on a path of its own, "
                   "untested with H2O",
}


def _check_mtp_layers(method: str | None, draft_model_config: Any) -> None:
    hf = getattr(draft_model_config, "hf_config", None)
    model_type = getattr(hf, "model_type", None)
    if _speculator(method) == "mtp" and model_type in _OWN_PROPOSER_MTP:
        raise ValueError(
            f"speculative decoding with {model_type} layers (--speculative-config) cannot be combined "
            f"with H2O KV eviction: {_OWN_PROPOSER_MTP[model_type]}. Use n-gram drafts "
            "('{\"method\": \"ngram\", \"num_speculative_tokens\": 3, \"prompt_lookup_max\": 4}'), drop "
            f"--speculative-config, {_OFF}")


def _check_device_ngram_runner(method: str | None, v2: bool) -> None:
    """Model Runner V1's ``ngram_gpu`` proposer allocates pinned host memory, which a CPU-only
    torch cannot: vLLM's CPU engine, where H2O's CUDA path is tested, cannot build it, so H2O
    with it is untested. V2 drafts ``ngram_gpu`` with its own kernel, tested."""
    if method == "ngram_gpu" and not v2:
        raise ValueError(
            "n-gram drafts on the device ('ngram_gpu', --speculative-config) cannot be combined with "
            "H2O KV eviction on vLLM's Model Runner V1 yet: V1's ngram_gpu proposer needs pinned host "
            "memory, which vLLM's CPU engine (where H2O's CUDA path is tested) cannot allocate, so "
            "that pairing is untested. Use Model Runner V2 (VLLM_USE_V2_MODEL_RUNNER=1, vLLM's CUDA "
            "default), or '{\"method\": \"ngram\", ...}' (drafts from the host, exact on both runners), "
            f"drop --speculative-config, {_OFF}")


def _check_speculative_args(args: Any) -> None:
    """``--speculative-config`` and its shorthands, as given (vLLM resolves them later)."""
    for method, num_tokens, flag in _speculators(args):
        check_speculative(method, num_tokens, flag)


def _speculators(args: Any) -> list[tuple[str | None, int | None, str]]:
    """(method, draft tokens, flag) of each speculator the arguments ask for."""
    found = []
    config = getattr(args, "speculative_config", None)
    if getattr(args, "spec_model", None) is not None:
        found.append(("draft_model", None, "--spec-model"))
    if getattr(args, "spec_method", None) is not None:
        found.append((args.spec_method, getattr(args, "spec_tokens", None), "--spec-method"))
    if isinstance(config, dict) and config:
        # vLLM infers a draft model (or EAGLE, MTP) from "model" when "method" is absent.
        method = config.get("method") or ("draft_model" if config.get("model") else None)
        found.append((method, config.get("num_speculative_tokens"), "--speculative-config"))
    return found


def check_speculative(method: str | None, num_tokens: int | None, flag: str) -> None:
    """Refuse a speculator H2O cannot run exactly with, naming the way out."""
    if _speculator(method) not in SPECULATORS:
        why = "H2O is shown exact with n-gram, draft-model, EAGLE / EAGLE-3 and MTP speculators only"
        raise ValueError(
            f"speculative decoding with method {method!r} ({flag}) cannot be combined with H2O KV "
            f"eviction yet: {why}. Use "
            '--speculative-config \'{"method": "ngram", "num_speculative_tokens": 3, '
            '"prompt_lookup_max": 4}\', \'{"method": "eagle3", "model": "<an EAGLE-3 head for '
            'this model>", "num_speculative_tokens": 3}\' or \'{"method": "draft_model", "model": '
            f'"<a smaller model with the same tokenizer>", "num_speculative_tokens": 3}}\' ('
            '\'{"method": "mtp", "num_speculative_tokens": 1}\' for a model with MTP layers of its own), '
            f'or drop {flag}, {_OFF}')
    if num_tokens is not None and num_tokens + 1 > MAX_PENDING:  # the drafts and the known token wait
        raise ValueError(
            f"num_speculative_tokens={num_tokens} ({flag}) is more than H2O keeps for one "
            f"verification step ({MAX_PENDING - 1} drafts). Lower num_speculative_tokens, {_OFF}")


def _refuse_split_batches(parallel: Any) -> None:
    """Micro-batching (DBO) and context parallelism build each step's attention metadata on
    paths of their own (per micro-batch, per context shard), which the runner hooks do not
    give H2O's plan: H2O would run without eviction there."""
    split = {"--enable-dbo": getattr(parallel, "enable_dbo", False),
             "--prefill-context-parallel-size": getattr(parallel, "prefill_context_parallel_size", 1) > 1,
             "--decode-context-parallel-size": getattr(parallel, "decode_context_parallel_size", 1) > 1}
    for flag, on in split.items():
        if on:
            raise ValueError(
                f"{flag} cannot be combined with H2O KV eviction: it builds each step's attention "
                "metadata per micro-batch or context shard, where H2O's step plan does not reach "
                f"(eviction would silently stop). Drop {flag}, {_OFF}")


def _refuse_pipeline_parallel(size: int) -> None:
    raise ValueError(
        f"pipeline parallelism (--pipeline-parallel-size {size}) is not supported with H2O KV "
        "eviction yet. Use --pipeline-parallel-size 1 (tensor parallelism works), "
        f"{_OFF}")
