"""BufferPool ([Note: buffer reuse]): reuse by size, never a buffer held elsewhere, bounded idle bytes."""

from __future__ import annotations

import torch

from zeroshard.core.buffers import BufferPool

CPU = torch.device("cpu")


def test_a_given_back_buffer_is_reused_for_the_same_size_and_dtype_only() -> None:
    pool = BufferPool(spare_bytes=1 << 20)
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
    pool = BufferPool(spare_bytes=1 << 20)
    a = pool.take(64, torch.float32, CPU)
    held = a[8:16]  # e.g. a view autograd or the user kept
    held.fill_(7.0)
    pool.give(a)
    assert pool.idle_bytes == 0
    c = pool.take(64, torch.float32, CPU)
    c.fill_(0.0)
    assert torch.equal(held, torch.full((8,), 7.0))
    # Once the last user lets go, the buffer is idle and reused.
    address = a.data_ptr()
    del a, held
    assert pool.idle_bytes == 256
    assert pool.take(64, torch.float32, CPU).data_ptr() == address


def test_a_copy_of_param_data_or_a_detached_alias_also_holds_the_buffer() -> None:
    pool = BufferPool(spare_bytes=1 << 20)
    a = pool.take(64, torch.float32, CPU)
    param = torch.nn.Parameter(torch.empty(0))
    param.data = a[:8].view(2, 4)  # a parameter pointed at the buffer, as a gathered unit does
    kept = param.data  # a user's reference, not an autograd view of the buffer
    param.data = torch.empty(0)
    pool.give(a)
    del a
    assert pool.idle_bytes == 0
    assert pool.take(64, torch.float32, CPU).data_ptr() != kept.data_ptr()
    del kept
    assert pool.idle_bytes == 256


def test_the_pool_footprint_stays_within_the_high_water_mark_plus_the_spare_bytes() -> None:
    pool = BufferPool(spare_bytes=2 * 300 * 4)  # two of the largest buffers, as the engine sets it
    sizes = [100, 300, 100, 50, 300, 200, 100, 90, 260]
    live: list[torch.Tensor] = []
    misses_per_step = []
    for step in range(4):
        misses = pool.misses
        for i, n in enumerate(sizes):
            live.append(pool.take(n, torch.float32, CPU))
            if len(live) > 2:  # about two live at a time, like a prefetching stage-3 forward
                pool.give(live.pop(0))
            footprint = pool.idle_bytes + pool.out_bytes
            assert footprint <= pool.high_water_bytes + pool.spare_bytes, (step, i)
        while live:
            pool.give(live.pop())
        misses_per_step.append(pool.misses - misses)
    # The same requests every step: after the first step every one finds an idle buffer.
    assert misses_per_step[0] > 0 and misses_per_step[1:] == [0, 0, 0], misses_per_step
    # A buffer the pool never handed out (the engine's initial parameters), larger than its room: not kept.
    before = pool.idle_bytes
    pool.give(torch.empty(10_000))
    assert pool.idle_bytes == before
    pool.clear()
    assert pool.idle_bytes == 0


def test_without_spare_bytes_idle_buffers_only_fill_the_room_below_the_high_water_mark() -> None:
    pool = BufferPool()
    a, b = pool.take(100, torch.float32, CPU), pool.take(100, torch.float32, CPU)  # high water 800 bytes
    pool.give(a)
    del a  # idle once nothing refers to it
    assert pool.idle_bytes == 400  # 400 out + 400 idle = the high-water mark
    c = pool.take(300, torch.float32, CPU)  # a miss: 1600 out, a new high-water mark, no room left idle
    assert pool.idle_bytes == 0 and pool.high_water_bytes == 1600
    pool.give(b)
    pool.give(c)
    address = c.data_ptr()
    del b, c
    assert pool.idle_bytes == 1600 and pool.out_bytes == 0
    assert pool.take(300, torch.float32, CPU).data_ptr() == address and pool.hits == 1


def test_exempt_requests_do_not_raise_the_high_water_mark() -> None:
    pool = BufferPool(spare_bytes=400)
    for _ in range(2):  # a training step's pattern: one 100-element buffer at a time
        pool.give(pool.take(100, torch.float32, CPU))
    with pool.exempt():  # the whole model gathered once, e.g. for generation
        held = [pool.take(100, torch.float32, CPU) for _ in range(10)]
    assert pool.high_water_bytes == 400
    for buf in held:
        pool.give(buf)
    del held, buf
    # Afterwards the pool keeps what the steps need plus the spare bytes, not the ten buffers.
    assert pool.idle_bytes <= pool.high_water_bytes + pool.spare_bytes == 800


def test_a_slightly_smaller_request_is_served_by_an_idle_buffer_and_gives_it_back_whole() -> None:
    pool = BufferPool(spare_bytes=1 << 20)
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


def test_new_buffers_are_rounded_up_so_that_requests_a_bias_apart_share_them() -> None:
    # A 4096 x 1024 linear with its bias and a 1024 x 4096 one with its bias: 3072 elements apart.
    pool = BufferPool(spare_bytes=1 << 26)
    a = pool.take(1024 * 4096 + 1024, torch.float32, CPU)
    address = a.data_ptr()
    pool.give(a)
    del a
    assert pool.idle_bytes <= (1024 * 4096 + 1024) * 4 * (1 + 1 / 64)
    b = pool.take(4096 * 1024 + 4096, torch.float32, CPU)
    assert b.data_ptr() == address and (pool.hits, pool.misses) == (1, 1)


def test_shrink_lets_go_of_the_oldest_given_back_buffers_and_counts_them() -> None:
    pool = BufferPool(spare_bytes=1 << 20)
    buffers = [pool.take(100, torch.float32, CPU) for _ in range(3)]
    addresses = [b.data_ptr() for b in buffers]
    for b in buffers:
        pool.give(b)
    del b, buffers
    assert pool.idle_bytes == 1200
    pool.shrink(500)  # room for one of them: the newest stays
    assert (pool.idle_bytes, pool.shrunk) == (400, 2)
    assert pool.take(100, torch.float32, CPU).data_ptr() == addresses[2]
    pool.shrink(-1)  # nothing kept, whatever the caller computed
    assert pool.shrunk == 2 and pool.idle_bytes == 0
