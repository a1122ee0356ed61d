"""--kv-eviction / --h2o-* flags: parsing, folding into additional_config, conflicts; per-request checks."""
import argparse

import pytest

from h2o_vllm.frontend import flags


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(exit_on_error=False)
    parser.add_argument("--additional-config", type=lambda s: __import__("json").loads(s), default={})
    flags.add_h2o_args(parser)
    return parser


def _fold(argv):
    args = _parser().parse_args(argv)
    flags.fold_namespace(args)
    return args.additional_config


def test_flags_fold_into_additional_config():
    assert _fold(["--kv-eviction", "h2o", "--h2o-heavy-ratio", "0.2", "--h2o-recent-tokens", "16",
                  "--h2o-interval", "4"]) == {"h2o": {"heavy_ratio": 0.2, "recent_tokens": 16, "interval": 4}}


def test_flags_kv_eviction_h2o_alone_is_paper_default():
    assert _fold(["--kv-eviction", "h2o"]) == {"h2o": {}}


def test_flags_h2o_flag_alone_implies_h2o():
    assert _fold(["--h2o-heavy-ratio", "0.05"]) == {"h2o": {"heavy_ratio": 0.05}}


def test_flags_absent_leave_config_untouched():
    assert _fold([]) == {}
    assert _fold(["--kv-eviction", "none"]) == {}
    assert _fold(["--additional-config", '{"other": 1}']) == {"other": 1}


def test_flags_merge_with_additional_config_and_keep_other_keys():
    assert _fold(["--additional-config", '{"other": 1, "h2o": {"heavy_ratio": 0.1}}',
                  "--h2o-recent-ratio", "0.3"]) == {"other": 1, "h2o": {"heavy_ratio": 0.1, "recent_ratio": 0.3}}


def test_flags_same_value_both_ways_is_fine():
    assert _fold(["--additional-config", '{"h2o": {"interval": 8}}', "--h2o-interval", "8"]) == \
        {"h2o": {"interval": 8}}


@pytest.mark.parametrize("argv, flag", [
    (["--additional-config", '{"h2o": {"heavy_ratio": 0.1}}', "--h2o-heavy-ratio", "0.2"], "--h2o-heavy-ratio"),
    (["--additional-config", '{"h2o": {"heavy_ratio": 0.1}}', "--h2o-heavy-tokens", "8"], "--h2o-heavy-tokens"),
    (["--additional-config", '{"h2o": {}}', "--kv-eviction", "none"], "--kv-eviction"),
    (["--kv-eviction", "none", "--h2o-interval", "4"], "--h2o-interval"),
    (["--h2o-heavy-ratio", "0", "--h2o-recent-ratio", "0"], "--h2o-heavy-ratio"),
    (["--kv-eviction", "h2o", "--additional-config", '{"h2o": {"bogus": 1}}'], "--additional-config"),
])
def test_flags_conflicts_are_errors_naming_the_flag(argv, flag):
    with pytest.raises(flags.FlagError, match=flag):
        _fold(argv)


@pytest.mark.parametrize("argv, flag", [
    (["--h2o-heavy-ratio", "1.5"], "--h2o-heavy-ratio"),
    (["--h2o-recent-ratio", "abc"], "--h2o-recent-ratio"),
    (["--h2o-heavy-tokens", "-1"], "--h2o-heavy-tokens"),
    (["--h2o-recent-tokens", "2.5"], "--h2o-recent-tokens"),
    (["--h2o-interval", "0"], "--h2o-interval"),
    (["--kv-eviction", "lru"], "--kv-eviction"),
])
def test_flags_bad_values_are_parse_errors_naming_the_flag(argv, flag):
    with pytest.raises(argparse.ArgumentError, match=flag):
        _parser().parse_args(argv)


def test_flags_group_added_once():
    parser = _parser()
    flags.add_h2o_args(parser)
    assert [g.title for g in parser._action_groups].count(flags.GROUP_TITLE) == 1


def test_flags_in_vllm_engine_parser_fold_at_parse_time():
    """Through vLLM's own parser, with the plugin's hook: folded namespace, argparse exit 2."""
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = AsyncEngineArgs.add_cli_args(FlexibleArgumentParser())  # loads the plugin first
    args = parser.parse_args(["--kv-eviction", "h2o", "--h2o-heavy-tokens", "8"])
    assert args.additional_config == {"h2o": {"heavy_tokens": 8}}
    assert AsyncEngineArgs.from_cli_args(args).additional_config == {"h2o": {"heavy_tokens": 8}}
    with pytest.raises(SystemExit) as exit_info:
        parser.parse_args(["--h2o-recent-tokens", "8", "--additional-config", '{"h2o": {"recent_ratio": 0.1}}'])
    assert exit_info.value.code == 2


@pytest.mark.parametrize("extra_args, match", [
    ({"h2o_heavy_ratio": 1.5}, "h2o_heavy_ratio"),
    ({"h2o_interval": 0}, "h2o_interval"),
    ({"h2o_heavy_ratio": 0, "h2o_recent_ratio": 0}, "budget is zero"),
    ({"h2o_heavy_tokens": "8"}, "h2o_heavy_tokens"),
])
def test_request_overrides_bad_values_raise_value_error(extra_args, match):
    from h2o_vllm.frontend.requests import check_request_overrides
    with pytest.raises(ValueError, match=match):
        check_request_overrides({"h2o": {}}, extra_args)


@pytest.mark.parametrize("additional_config", [{"h2o": {}}, {}], ids=["h2o-on", "h2o-off"])
def test_unknown_h2o_keys_are_refused_naming_the_key_and_the_valid_ones(additional_config):
    """A typo must not run the engine's budget unannounced (issue 28); other keys pass."""
    from h2o_vllm.frontend.requests import check_request_overrides
    with pytest.raises(ValueError, match="unknown H2O key h2o_heavy_tokns") as info:
        check_request_overrides(additional_config, {"h2o_heavy_tokns": 32, "h2o_recent_tokens": 8})
    assert "h2o_heavy_tokens" in str(info.value) and "h2o_prefill_chunk" in str(info.value)
    check_request_overrides(additional_config, {"other_plugin_key": 1, "H2O_heavy": 2})


def test_request_overrides_need_h2o_on():
    from h2o_vllm.frontend.requests import check_request_overrides
    with pytest.raises(ValueError, match="off"):
        check_request_overrides({}, {"h2o_heavy_ratio": 0.1})
    check_request_overrides({}, {"unrelated": 1})
    check_request_overrides({"h2o": {"heavy_tokens": 4}}, {"h2o_heavy_ratio": 0.05, "h2o_recent_ratio": 0.05})


def test_flags_score_modes_fold_and_refuse():
    assert _fold(["--h2o-pool-kernel", "15", "--h2o-obs-window", "16"]) == \
        {"h2o": {"pool_kernel": 15, "obs_window": 16}}
    with pytest.raises(argparse.ArgumentError, match="--h2o-pool-kernel.*odd"):
        _parser().parse_args(["--h2o-pool-kernel", "8"])
    from h2o_vllm.frontend.requests import check_request_overrides
    with pytest.raises(ValueError, match="h2o_pool_kernel"):
        check_request_overrides({"h2o": {}}, {"h2o_pool_kernel": 2})


def _served(num_gpu_blocks, h2o, max_model_len=4096, prefix_caching=False, dp=1, layer_types=None,
            window=None, block_size=16):
    from types import SimpleNamespace
    return SimpleNamespace(
        additional_config={"h2o": h2o},
        cache_config=SimpleNamespace(num_gpu_blocks=num_gpu_blocks, block_size=block_size,
                                     enable_prefix_caching=prefix_caching),
        model_config=SimpleNamespace(max_model_len=max_model_len, hf_text_config=SimpleNamespace(layer_types=layer_types),
                                     get_sliding_window=lambda: window),
        scheduler_config=SimpleNamespace(max_num_batched_tokens=8192, disable_hybrid_kv_cache_manager=False),
        parallel_config=SimpleNamespace(data_parallel_size=dp))


def test_a_request_that_can_never_fit_the_pool_is_refused_naming_the_fix():
    """65 blocks (64 usable): a 2,000-token prompt held whole needs 125; in chunks of 256 at
    8 + 8 tokens it needs 17; the pool's size comes from the engine (unknown before: no check)."""
    from h2o_vllm.frontend.requests import check_request_fits
    tokens = {"heavy_tokens": 8, "recent_tokens": 8}
    with pytest.raises(ValueError, match=r"needs up to 125 KV blocks.*pool's 64.*h2o_prefill_chunk"):
        check_request_fits(_served(65, tokens), 2000, 16, None)
    check_request_fits(_served(65, tokens), 2000, 16, {"h2o_prefill_chunk": 256})
    check_request_fits(_served(65, {**tokens, "prefill_chunk": 256}), 2000, 16, None)
    check_request_fits(_served(None, tokens), 2000, 16, None)
    with pytest.raises(ValueError, match="lower h2o_prefill_chunk or the budget"):
        check_request_fits(_served(65, tokens), 2000, 16, {"h2o_prefill_chunk": 1100})
    # Data parallel: process 0 sums the engines' pools; a request runs in one.
    with pytest.raises(ValueError, match="pool's 64"):
        check_request_fits(_served(130, tokens, dp=2), 2000, 16, None)


GEMMA3_270M_LAYERS = (["sliding_attention"] * 5 + ["full_attention"]) * 3


def test_a_hybrid_request_counts_every_kv_cache_group_of_the_shared_pool():
    """Gemma 3 270M: vLLM makes 1 full-attention and 5 sliding-window groups of 3 layers. A
    1,100-token prompt (+ 24 tokens) held whole needs cdiv(1100, 32) = 35 blocks in H2O's group
    (then it compacts) and cdiv(1124, 32) = 36 in each sliding group (the prompt is one step,
    before vLLM drops what leaves the window): 215, where a model of full layers needs 35."""
    from h2o_vllm.frontend.requests import check_request_fits, kv_cache_group_counts
    hybrid = dict(layer_types=GEMMA3_270M_LAYERS, window=512, block_size=32)
    assert kv_cache_group_counts(_served(100, {}, **hybrid)) == (1, 5)
    with pytest.raises(ValueError, match=r"needs up to 215 KV blocks.*35 in each of 1 full-attention "
                                         r"KV-cache groups and 36 in each of 5 sliding-window ones.*pool's 199"):
        check_request_fits(_served(200, {}, **hybrid), 1100, 24, None)
    check_request_fits(_served(216, {}, **hybrid), 1100, 24, None)
    check_request_fits(_served(200, {}, layer_types=["full_attention"] * 18, block_size=32), 1100, 24, None)
    # In chunks of 256 a sliding group holds the window before a chunk plus the chunk:
    # cdiv(511 + 256, 32) + 1 = 25 blocks, and H2O's group its chunked peak.
    with pytest.raises(ValueError, match=r"25 in each of 5 sliding-window ones"):
        check_request_fits(_served(100, {}, **hybrid), 1100, 24, {"h2o_prefill_chunk": 256})
