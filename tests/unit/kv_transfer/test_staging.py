"""kv_transfer.staging.Staging: first-fit reservations, given back when every rank has read
them or when their lease runs out; tickets never reused."""
from h2o_vllm.kv_transfer.staging import Staging


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def test_first_fit_reuses_the_lowest_free_run():
    staging = Staging(100, world_size=1, ttl_s=10)
    a, b, c = staging.reserve(30), staging.reserve(30), staging.reserve(30)
    assert (a.offset, b.offset, c.offset) == (0, 30, 60)
    assert staging.reserve(20) is None
    staging.drop(b.ticket)
    d = staging.reserve(20)
    assert d.offset == 30 and d.ticket not in (a.ticket, b.ticket, c.ticket)
    assert staging.reserve(10).offset == 50
    assert staging.used == 90


def test_given_back_once_every_rank_read_it():
    staging = Staging(100, world_size=2, ttl_s=10)
    r = staging.reserve(60)
    staging.commit(r.ticket)
    staging.read(r.ticket, 0)
    staging.read(r.ticket, 0)  # the same rank twice counts once
    assert staging.reserve(60) is None
    staging.read(r.ticket, 1)
    assert staging.reserve(60).offset == 0
    staging.read(r.ticket, 0)  # late news of a ticket given back releases nothing
    assert staging.used == 60


def test_a_committed_state_never_read_is_given_back_after_its_lease():
    clock = Clock()
    staging = Staging(100, world_size=1, ttl_s=10, clock=clock)
    saving, named = staging.reserve(40), staging.reserve(40)
    staging.commit(named.ticket)
    clock.now = 9.9
    staging.expire()
    assert staging.used == 80
    clock.now = 10.0
    assert staging.reserve(50).offset == 40  # expired first; a save in progress has no lease
    assert staging.num_expired == 1 and saving.ticket in staging.held
