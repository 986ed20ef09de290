"""BufferPool ([Note: buffer reuse]): reuse by size, never a buffer held elsewhere, bounded idle bytes."""

from __future__ import annotations

import torch

from zeroshard.buffers import BufferPool

CPU = torch.device("cpu")


def test_a_given_back_buffer_is_reused_for_the_same_size_and_dtype_only() -> None:
    pool = BufferPool(idle_limit=1 << 20)
    a = pool.take(1000, torch.float32, CPU)
    address = a.data_ptr()
    pool.give(a)
    del a
    assert pool.idle_bytes == 4000
    b = pool.take(1000, torch.float32, CPU)
    assert b.data_ptr() == address and (pool.hits, pool.misses) == (1, 1)
    assert pool.idle_bytes == 0
    pool.give(b)
    pool.take(1000, torch.bfloat16, CPU)  # another dtype: not that buffer
    assert (pool.hits, pool.misses) == (1, 2)


def test_a_buffer_still_referenced_elsewhere_is_not_reused() -> None:
    pool = BufferPool(idle_limit=1 << 20)
    a = pool.take(64, torch.float32, CPU)
    held = a[8:16]  # e.g. a view autograd or the user kept
    held.fill_(7.0)
    pool.give(a)
    assert pool.idle_bytes == 0
    c = pool.take(64, torch.float32, CPU)
    c.fill_(0.0)
    assert torch.equal(held, torch.full((8,), 7.0))


def test_the_pool_keeps_at_most_its_idle_limit_and_what_it_handed_out_at_once() -> None:
    pool = BufferPool(idle_limit=2 * 300 * 4)  # two of the largest buffers, as the engine sets it
    sizes = [100, 300, 100, 50, 300, 200, 100, 90, 260]
    live: list[torch.Tensor] = []
    for step in range(3):
        for i, n in enumerate(sizes):
            live.append(pool.take(n, torch.float32, CPU))
            if len(live) > 2:  # about two live at a time, like a prefetching stage-3 forward
                pool.give(live.pop(0))
            assert pool.idle_bytes <= min(pool.idle_limit, pool.high_water_bytes), (step, i)
        while live:
            pool.give(live.pop())
    assert pool.hits > pool.misses
    # A buffer the pool never handed out (the engine's initial parameters) is not kept.
    before = pool.idle_bytes
    pool.give(torch.empty(10_000))
    assert pool.idle_bytes == before
    pool.clear()
    assert pool.idle_bytes == 0


def test_a_slightly_smaller_request_is_served_by_an_idle_buffer_and_gives_it_back_whole() -> None:
    pool = BufferPool(idle_limit=1 << 20)
    a = pool.take(1000, torch.float32, CPU)
    address = a.data_ptr()
    pool.give(a)
    del a
    b = pool.take(900, torch.float32, CPU)  # within the slack: the 1000-element buffer, as 900 elements
    assert b.shape == (900,) and b.data_ptr() == address
    pool.give(b)
    del b
    assert pool.idle_bytes == 4000  # back whole
    c = pool.take(700, torch.float32, CPU)  # beyond the slack: a new buffer
    assert c.data_ptr() != address and pool.misses == 2
    assert pool.take(1000, torch.float32, CPU).data_ptr() == address


def test_between_steps_the_pool_keeps_only_the_newest_keep_between_steps_bytes() -> None:
    pool = BufferPool(idle_limit=1 << 20, keep_between_steps=800)
    bufs = [pool.take(100, torch.float32, CPU) for _ in range(5)]  # 400 bytes each
    newest = [b.data_ptr() for b in bufs[-2:]]
    for b in bufs:
        pool.give(b)
    del bufs, b
    assert pool.idle_bytes == 2000
    pool.end_step()
    assert pool.idle_bytes == 800
    kept = {pool.take(100, torch.float32, CPU).data_ptr() for _ in range(2)}
    assert kept == set(newest)  # the last given back: what the next forward's first gathers want
