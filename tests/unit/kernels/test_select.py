"""The keep-set kernel (h2o_vllm.kernels.select.select_keep_rows): the keep-sets of
``worker.due_pass.keep_sets`` (hence ``policy.select_keep``'s) from one launch, over scores
full of ties, negative and -0.0 scores, sinks, pooling and rows not due, which it leaves alone.
Interpreted on the CPU (TRITON_INTERPRET=1)."""
from kernel_cases import DEVICE, INTERPRETED  # isort: skip

import pytest  # noqa: E402
import torch  # noqa: E402

from h2o_vllm.kernels import select  # noqa: E402
from h2o_vllm.score_modes import Pooling  # noqa: E402
from h2o_vllm.worker import due_pass  # noqa: E402
from h2o_vllm.worker.plan import StepPlan  # noqa: E402

if not INTERPRETED and not torch.cuda.is_available():
    pytest.skip("Triton kernels were compiled (TRITON_INTERPRET unset when first imported) and "
                "there is no GPU", allow_module_level=True)

BLOCK, HEADS = 16, 2
KV_LENS = [1, 5, 17, 33, 40, 64, 29, 12]
HEAVY = [0, 2, 4, 8, 3, 20, 6, 0]
SINKS = [0, 1, 2, 0, 4, 3, 0, 2]
RECENT = [1, 1, 5, 8, 0, 10, 4, 12]


def due_pass_of(pooled: bool):
    t = lambda xs: torch.tensor(xs, dtype=torch.int64)  # noqa: E731
    after = [min(n, s + h + r) for n, s, h, r in zip(KV_LENS, SINKS, HEAVY, RECENT)]
    after[6] = KV_LENS[6]  # not due
    ranking = tuple((Pooling(3),) if pooled and i % 3 else () for i in range(len(KV_LENS)))
    kv = t(KV_LENS)
    plan = StepPlan(query_lens=torch.ones_like(kv), kv_lens_before=kv - 1, kv_seq_lens=kv,
                    kv_lens_after=t(after), heavy=t(HEAVY), sink_tokens=t(SINKS), rank=ranking,
                    due=t(after) < kv, query_starts=torch.arange(len(KV_LENS)), ranking=ranking)
    table = torch.arange(1, 1 + 4 * len(KV_LENS), dtype=torch.int32).view(len(KV_LENS), 4)
    (due,) = due_pass.due_passes(plan, table.to(DEVICE), BLOCK, every_row=True)
    return due


@pytest.mark.parametrize("scores", ["ties", "signed", "continuous"])
@pytest.mark.parametrize("pooled", [False, True], ids=["plain", "pooled"])
def test_the_kernel_keeps_what_the_sorts_keep(scores, pooled):
    due = due_pass_of(pooled)
    gen = torch.Generator().manual_seed(len(scores) + pooled)
    shape = (len(KV_LENS), HEADS, due.blocks.shape[1])
    if scores == "ties":  # small integers: most choices are decided by the tie rule
        ranked = torch.randint(0, 4, shape, generator=gen).float()
    elif scores == "signed":  # KeyDiff's range, zeros of both signs
        ranked = torch.randint(-2, 3, shape, generator=gen).float() * 0.5
        ranked[ranked == 0] = torch.where(torch.rand(int((ranked == 0).sum()), generator=gen) < 0.5, -0.0, 0.0)
    else:
        ranked = torch.rand(shape, generator=gen) * 3
    ranked = ranked.to(DEVICE)
    want_keep, want_idx = due_pass.keep_sets(due, ranked)
    keep, keep_idx = select.select_keep_rows(due_pass.ranked_candidates(due, ranked), due.live,
                                             due.due, due.sink_end, due.recent_start, due.num_heavy)
    for row in range(len(KV_LENS)):
        if not bool(due.due[row]):
            continue
        target = int(due.targets[row])
        assert torch.equal(keep[row], want_keep[row]), row
        assert torch.equal(keep_idx[row, :, :target], want_idx[row, :, :target]), row


def test_rows_not_due_are_left_alone():
    due = due_pass_of(False)
    ranked = torch.rand(len(KV_LENS), HEADS, due.blocks.shape[1]).to(DEVICE)
    keep = torch.full(ranked.shape, True, device=DEVICE)
    idx = torch.full(ranked.shape, -7, dtype=torch.int64, device=DEVICE)
    not_due = due.due.clone()
    not_due[:] = False
    select.select_keep_rows_kernel[(len(KV_LENS), HEADS)](
        ranked, due.live, not_due, due.sink_end, due.recent_start, due.num_heavy, keep, idx,
        ranked.stride(0), ranked.stride(1), due.live.stride(0), keep.stride(0), keep.stride(1),
        idx.stride(0), idx.stride(1), W=ranked.shape[-1], LOG_W=ranked.shape[-1].bit_length() - 1)
    assert bool(keep.all()) and bool((idx == -7).all())
