"""soak.jobs.plan: seeded, within max_model_len, and a share of prompts on shared prefixes
(the soak's prefix-cache hits)."""
from h2o_devtools.soak import jobs


def test_plan_is_seeded_and_fits_the_model_length():
    cfg = jobs.SoakConfig(requests=200, seed=5)
    first, again = list(jobs.plan(cfg)), list(jobs.plan(cfg))
    assert [j.prompt for j in first] == [j.prompt for j in again]
    assert all(1 <= len(j.prompt) and len(j.prompt) + j.max_tokens <= cfg.max_model_len for j in first)


def test_a_share_of_prompts_starts_with_a_shared_prefix():
    cfg = jobs.SoakConfig(requests=400, seed=5)
    prompts = [j.prompt for j in jobs.plan(cfg)]
    long = [p for p in prompts if len(p) >= 40]
    heads = [tuple(p[:40]) for p in long]
    shared = [h for h in heads if heads.count(h) > 1]
    share = len(shared) / len(long)
    assert 0.25 < share < 0.55, share  # about shared_prefix_share; random heads never repeat
    none = jobs.SoakConfig(requests=400, seed=5, shared_prefix_share=0.0)
    heads = [tuple(j.prompt[:40]) for j in jobs.plan(none) if len(j.prompt) >= 40]
    assert len(set(heads)) == len(heads)
