"""Pages, prefix sharing, eviction and admission: the counts always come back."""

from __future__ import annotations

import pytest
import torch

from splitserve.engine.kv_cache import KVCache
from splitserve.engine.kv_pool import KVPool, KVPoolShape
from splitserve.engine.page_allocator import DoubleFreeError, OutOfPagesError, PageAllocator
from splitserve.engine.request import Request, RequestStatus
from splitserve.engine.sampling_params import SamplingParams
from splitserve.engine.scheduler import Scheduler, SchedulerConfig, prefill_budget


def make_request(rid: str, prompt: list[int], max_new: int = 8) -> Request:
    return Request(rid, list(prompt), SamplingParams(max_new_tokens=max_new), on_output=lambda _o: None)


def kv_cache(pages: int = 17, page_size: int = 4, slots: int = 4) -> KVCache:
    return KVCache(pages, page_size, slots, max_context=256, device=torch.device("cpu"))


def assert_all_back(kv: KVCache) -> None:
    u = kv.usage()
    assert u.locked == 0 and u.slots_in_use == 0
    assert u.free + u.cached == u.capacity


def test_allocator_never_hands_out_the_scratch_page_and_refuses_double_free() -> None:
    alloc = PageAllocator(5)
    pages = alloc.alloc(4)
    assert sorted(pages) == [1, 2, 3, 4]
    with pytest.raises(OutOfPagesError):
        alloc.alloc(1)
    alloc.free(pages[:1])
    with pytest.raises(DoubleFreeError):
        alloc.free(pages[:1])
    with pytest.raises(DoubleFreeError):
        alloc.free([0])
    assert alloc.free_count == 1


def test_finished_request_pages_are_shared_by_the_next_with_the_same_prefix() -> None:
    kv = kv_cache()
    a = make_request("a", list(range(10)))
    kv.admit(a, max_prefix_tokens=9)
    assert a.kv_len == 0
    assert kv.grow(a, 10)
    a.kv_len = 10
    a_pages = list(a.pages)
    kv.release(a)
    # Two full pages (8 tokens) are cached; the partial third page was freed.
    assert kv.usage().cached == 2
    b = make_request("b", [*list(range(8)), 99, 98, 97])
    kv.admit(b, max_prefix_tokens=10)
    assert b.pages == a_pages[:2] and b.kv_len == 8 and b.cached_len == 8
    assert kv.usage().locked == 2
    assert torch.equal(kv.page_table[b.slot, :2], torch.tensor(a_pages[:2], dtype=torch.int32))
    kv.release(b)
    assert_all_back(kv)


def test_prefix_match_keeps_at_least_one_token_to_compute() -> None:
    kv = kv_cache()
    a = make_request("a", list(range(8)))
    kv.admit(a, 7)
    kv.grow(a, 8)
    a.kv_len = 8
    kv.release(a)
    again = make_request("again", list(range(8)))
    kv.admit(again, max_prefix_tokens=7)  # the same 8-token prompt: only the first page may match
    assert again.kv_len == 4
    kv.release(again)
    assert_all_back(kv)


def test_eviction_frees_least_recently_used_unlocked_pages_first() -> None:
    kv = kv_cache(pages=9, page_size=2)  # 8 usable pages
    for rid, base in (("old", 100), ("new", 200)):
        r = make_request(rid, [base + i for i in range(8)])
        kv.admit(r, 0)
        kv.grow(r, 8)
        r.kv_len = 8
        kv.release(r)
    assert kv.usage().cached == 8 and kv.usage().free == 0
    big = make_request("big", list(range(8)))
    kv.admit(big, 0)
    assert kv.grow(big, 8)  # needs 4 pages: the 4 of "old" are evicted
    assert kv.prefix_cache.match([200 + i for i in range(8)]).num_pages == 4
    assert kv.prefix_cache.match([100 + i for i in range(8)]).num_pages == 0
    kv.release(big, cache_prefix=False)
    assert_all_back(kv)


def test_locked_pages_are_never_evicted() -> None:
    kv = kv_cache(pages=5, page_size=2)  # 4 usable pages
    a = make_request("a", [1, 2, 3, 4, 5])
    kv.admit(a, 0)
    kv.grow(a, 4)
    a.kv_len = 4
    kv.release(a)
    b = make_request("b", [1, 2, 3, 4, 9])
    kv.admit(b, 4)  # locks the 2 cached pages
    c = make_request("c", [7, 7, 7, 7, 7, 7])
    kv.admit(c, 0)
    assert not kv.grow(c, 6)  # needs 3, only 2 free: the locked ones stay
    assert b.pages == kv.prefix_cache.match([1, 2, 3, 4]).pages
    kv.release(c)
    kv.release(b)
    assert_all_back(kv)


def scheduler(pages: int, page_size: int = 4, slots: int = 4, chunk: int = 8, decode_first: bool = False) -> Scheduler:
    kv = kv_cache(pages, page_size, slots)
    return Scheduler(SchedulerConfig(max_running_requests=slots, chunked_prefill_size=chunk, context_length=256,
                                     decode_first=decode_first), kv)


def run_plan(plan) -> None:
    """Pretends to run the step: KV is now computed; sampled chunks get a new token."""
    for c in plan.chunks:
        c.request.kv_len += c.length
        if c.sample:
            c.request.output_ids.append(1)


def test_chunked_prefill_splits_a_long_prompt_within_the_budget() -> None:
    s = scheduler(pages=40, chunk=8)
    req = make_request("long", list(range(20)))
    s.add(req)
    lengths = []
    for _ in range(3):
        plan = s.schedule()
        lengths.append([(c.start, c.length, c.sample) for c in plan.chunks])
        run_plan(plan)
    assert lengths == [[(0, 8, False)], [(8, 8, False)], [(16, 4, True)]]
    plan = s.schedule()
    assert [(c.start, c.length, c.sample) for c in plan.chunks] == [(20, 1, True)]


def test_decodes_run_beside_a_new_prompt_chunk() -> None:
    s = scheduler(pages=40, chunk=8, decode_first=True)
    first = make_request("first", [1, 2, 3])
    s.add(first)
    run_plan(s.schedule())
    second = make_request("second", list(range(30, 42)))
    s.add(second)
    plan = s.schedule()
    # One token budget per step: the decode takes one of the 8, the prompt chunk the other 7.
    assert [(c.request.request_id, c.length) for c in plan.chunks] == [("first", 1), ("second", 7)]


def test_decodes_wait_while_prompts_fill_the_step_then_share_it() -> None:
    s = scheduler(pages=40, chunk=8)
    first = make_request("first", [1, 2, 3])
    s.add(first)
    run_plan(s.schedule())
    second = make_request("second", list(range(30, 42)))  # 12 prompt tokens: more than a step's 8
    s.add(second)
    steps = []
    for _ in range(3):
        plan = s.schedule()
        steps.append([(c.request.request_id, c.length) for c in plan.chunks])
        run_plan(plan)
    # A full step of prompt alone; its last 4 tokens no longer fill one, so the decode rides beside them.
    assert steps == [[("second", 8)], [("first", 1), ("second", 4)], [("first", 1), ("second", 1)]]


def test_a_prompt_step_that_cannot_start_lets_the_decodes_run() -> None:
    s = scheduler(pages=6, page_size=4, chunk=8)  # 5 usable pages = 20 tokens
    first = make_request("first", [1, 2, 3])
    s.add(first)
    run_plan(s.schedule())
    big = make_request("big", list(range(30, 48)))  # 18 tokens: 5 pages, 4 are free
    s.add(big)
    plan = s.schedule()
    assert [(c.request.request_id, c.length) for c in plan.chunks] == [("first", 1)]
    assert list(s.waiting) == [big] and big.slot == -1 and big.pages == []


def test_decodes_share_the_step_budget_and_leave_prompts_at_least_an_eighth() -> None:
    s = scheduler(pages=200, page_size=4, slots=16, chunk=16, decode_first=True)
    for i in range(10):
        s.add(make_request(f"d{i}", [i + 1]))
    run_plan(s.schedule())  # ten one-token prompts: all prefilled in the first step
    s.add(make_request("late", list(range(40))))
    plan = s.schedule()
    assert [c.length for c in plan.chunks] == [1] * 10 + [6]  # 16 - 10 decodes
    s2 = scheduler(pages=200, page_size=4, slots=16, chunk=16, decode_first=True)
    for i in range(14):
        s2.add(make_request(f"d{i}", [i + 1]))
    run_plan(s2.schedule())  # 14 decodes leave 2 tokens of 16, also the floor (an eighth)
    s2.add(make_request("late", list(range(40))))
    assert [c.length for c in s2.schedule().chunks] == [1] * 14 + [2]
    assert prefill_budget(16, 40) == 2


def test_waiting_request_is_not_admitted_without_pages_for_its_prompt() -> None:
    s = scheduler(pages=5, page_size=4, chunk=64)  # 4 usable pages = 16 tokens
    a = make_request("a", list(range(12)))
    b = make_request("b", list(range(100, 108)))
    s.add(a)
    s.add(b)
    plan = s.schedule()
    assert [c.request.request_id for c in plan.chunks] == ["a"]
    assert b.status is RequestStatus.WAITING and b.slot == -1 and list(s.waiting) == [b]


def test_preemption_requeues_the_newest_request_and_frees_its_pages() -> None:
    s = scheduler(pages=5, page_size=2, chunk=64)  # 4 usable pages = 8 tokens
    old = make_request("old", [1, 2, 3])
    new = make_request("new", [4, 5, 6])
    s.add(old)
    s.add(new)
    new.arrival_time = old.arrival_time + 1
    run_plan(s.schedule())  # both prefilled: 2 pages each, all 4 used
    for _ in range(2):  # old grows to 5 tokens: needs a 3rd page, only by preempting new
        plan = s.schedule()
        run_plan(plan)
    assert new.status is RequestStatus.WAITING and new.slot == -1 and new.pages == []
    assert s.waiting[0] is new
    assert old.status is RequestStatus.RUNNING
    # new's computed prompt went to the prefix cache: re-admission reuses it.
    s.kv.release(old)
    s.running.remove(old)
    plan = s.schedule()
    assert plan.chunks[0].request is new and new.cached_len == 2


def test_extend_plan_covers_every_query_once_latest_blocks_first() -> None:
    from splitserve.engine.layers.extend_plan import block_tokens, extend_plan_from, extend_plan_values, wide_tiles

    assert [block_tokens(g, wide=False) for g in (1, 4, 7, 8, 16)] == [256, 64, 32, 32, 16]
    assert [block_tokens(g, wide=True) for g in (1, 4, 8)] == [128, 32, 16]  # float32 or wider heads: half the rows
    assert wide_tiles(64, 4) and wide_tiles(256, 2) and not wide_tiles(128, 2)
    lengths, kv_lens, slots = [1, 1, 40, 3], [9, 20, 50, 3], [5, 6, 7, 8]
    values, chunks, blocks = extend_plan_values(lengths, kv_lens, slots, tokens_per_block=16, first_chunk=2)
    assert (chunks, blocks) == (2, 4)
    # Every section padded to 4 int32s (16 bytes): slots, first rows (after the two decode rows,
    # then after the 40), lengths, KV lengths, the programs' chunks and first queries.
    assert values == [7, 8, 0, 0, 2, 42, 0, 0, 40, 3, 0, 0, 50, 3, 0, 0, 0, 0, 0, 1, 32, 16, 0, 0]
    plan = extend_plan_from(torch.tensor(values), chunks, blocks)
    assert plan.chunk_kv_len.tolist() == [50, 3] and plan.block_start.tolist() == [32, 16, 0, 0]


def test_full_chunks_after_whole_chunks_leave_the_extend_plan_for_the_cudnn_path() -> None:
    from splitserve.engine.layers.extend_plan import PrefixChunk, cudnn_prefixes, extend_plan_values, prefix_chunks

    assert cudnn_prefixes(2048, 8256) == [2048, 4096, 6144] and cudnn_prefixes(2048, 131072)[-1] == 32768
    # A decode row, a fresh prompt, a full chunk after two, a short chunk over a prefix, a full chunk after a
    # prefix that is not whole chunks, a full chunk after four, a short one after two.
    lengths, kv_lens = [1, 40, 32, 8, 32, 32, 20], [9, 40, 96, 108, 50, 160, 84]
    slots = [5, 6, 7, 8, 9, 3, 4]
    long_chunks = prefix_chunks(lengths, kv_lens, 32, first_chunk=1)
    assert long_chunks == (PrefixChunk(2, 41, 32, 64, 0), PrefixChunk(5, 113, 32, 128, 96))
    assert [c.kv_len for c in long_chunks] == [96, 160]
    assert prefix_chunks(lengths, kv_lens, 32, first_chunk=1, max_prefix=100) == long_chunks[:1]
    assert prefix_chunks(lengths, kv_lens, 32, first_chunk=3) == (PrefixChunk(5, 113, 32, 128, 0),)
    values, chunks, blocks = extend_plan_values(lengths, kv_lens, slots, tokens_per_block=16, first_chunk=1,
                                                skip_rows=frozenset(c.row for c in long_chunks))
    # The plan keeps the four others at their own rows: slots, rows, lengths, KV lengths, then the programs.
    assert (chunks, blocks) == (4, 8)
    assert values[:16] == [6, 8, 9, 4, 1, 73, 81, 145, 40, 8, 32, 20, 40, 108, 50, 84]
    assert values[16:] == [0, 0, 0, 1, 2, 2, 3, 3, 32, 16, 0, 0, 16, 0, 16, 0]


def test_a_batch_s_cudnn_chunks_carry_the_kv_locations_the_reference_path_would_gather() -> None:
    from splitserve.engine.runner.model_runner import build_forward_batch
    from splitserve.engine.scheduler import ScheduledChunk

    kv = KVCache(600, 16, 4, max_context=8192, device=torch.device("cpu"))
    short, long, odd = (make_request("short", list(range(40))), make_request("long", [7] * 4096),
                        make_request("odd", [8] * 4101))
    for r in (short, long, odd):
        kv.admit(r, max_prefix_tokens=0)
        assert kv.grow(r, len(r.prompt_ids))
    chunks = [ScheduledChunk(short, 0, 40, True), ScheduledChunk(long, 2048, 2048, True),
              ScheduledChunk(odd, 2053, 2048, True)]
    paged = build_forward_batch(chunks, kv.page_table, kv.page_size, torch.device("cpu"), tokens_per_block=64,
                                cudnn_chunk=2048)
    reference = build_forward_batch(chunks, kv.page_table, kv.page_size, torch.device("cpu"))
    (chunk,) = paged.prefix_chunks  # odd's prefix is not whole chunks: the extend kernel's
    assert (chunk.index, chunk.row, chunk.length, chunk.prefix) == (1, 40, 2048, 2048)
    assert torch.equal(paged.prefix_chunk_loc, reference.kv_indices[1, :4096])
    assert paged.extend_chunks == 2
    plain = build_forward_batch(chunks, kv.page_table, kv.page_size, torch.device("cpu"), tokens_per_block=64)
    assert plain.prefix_chunks == () and plain.extend_chunks == 3


def test_a_request_whose_last_token_is_in_flight_gets_no_decode_row() -> None:
    s = scheduler(pages=40, chunk=8)
    done_soon = make_request("done-soon", [1, 2, 3], max_new=2)
    going_on = make_request("going-on", [4, 5, 6])
    s.add(done_soon)
    s.add(going_on)
    run_plan(s.schedule())  # both prefilled, a first token each
    plan = s.schedule()
    for c in plan.chunks:  # under the overlap scheduler: launched, its token not yet read back
        c.request.kv_len += c.length
    plan = s.schedule()
    # done-soon's second (last) token is in flight: nothing to run for it; going-on decodes on.
    assert [c.request.request_id for c in plan.chunks] == ["going-on"]


def test_requests_with_the_prompt_of_one_being_computed_wait_for_its_pages() -> None:
    """Four samples of one 14-token prompt (pages of 4), chunked by 8: the first computes the prompt,
    the others wait until its pages are in the prefix cache and compute only the last 2 tokens; an
    unrelated request is not held back."""
    s = scheduler(pages=40, page_size=4, slots=8, chunk=8)
    prompt = list(range(50, 64))
    samples = [make_request(f"s{j}", prompt) for j in range(4)]
    other = make_request("other", list(range(100, 106)))
    for r in [*samples, other]:
        s.add(r)
    computed: dict[str, int] = {}
    for _ in range(4):
        plan = s.schedule()
        for c in plan.chunks:
            if c.start < len(c.request.prompt_ids):
                computed[c.request.request_id] = computed.get(c.request.request_id, 0) + c.length
        run_plan(plan)
        for c in plan.chunks:
            if c.start < len(c.request.prompt_ids):
                s.kv.publish_prompt(c.request, c.start + c.length)
    assert computed == {"s0": 14, "other": 6, "s1": 2, "s2": 2, "s3": 2}
    assert [r.cached_len for r in samples] == [0, 12, 12, 12]
    assert s.kv.usage().cached == s.kv.usage().locked == 3 + 1  # the prompt's 3 full pages, other's 1
    for r in [*samples, other]:
        s.running.remove(r)
        s.kv.release(r)
    assert_all_back(kv=s.kv)


def copying_scheduler(pages: int, page_size: int, slots: int, chunk: int) -> tuple[Scheduler, KVPool]:
    """A scheduler whose KV cache copies partial pages in a real (CPU) KV pool."""
    pool = KVPool(KVPoolShape(num_layers=2, num_pages=pages, page_size=page_size, num_kv_heads=1, head_dim=2,
                              dtype=torch.float32), torch.device("cpu"))
    kv = KVCache(pages, page_size, slots, max_context=256, device=torch.device("cpu"), copy_page=pool.copy_page)
    return Scheduler(SchedulerConfig(max_running_requests=slots, chunked_prefill_size=chunk, context_length=256),
                     kv), pool


def write_kv(pool: KVPool, req: Request, start: int, length: int) -> None:
    """What a forward pass writes: a value per (position, token) into the request's pages."""
    for pos in range(start, start + length):
        page, off = req.pages[pos // pool.shape.page_size], pos % pool.shape.page_size
        pool.buffer[:, :, page, off] = float(1000 * pos + req.all_ids[pos])


@pytest.mark.parametrize("prompt_len", [14, 12, 3])
def test_samples_of_a_computed_prompt_copy_its_last_page_and_run_only_their_last_token(prompt_len: int) -> None:
    """Four samples of one prompt (pages of 4, chunks of 8): the first computes it; the others
    share its full pages and take a copy of the page with their last tokens (its partial last page,
    a cached full page when the prompt ends on a page boundary), so each runs one token; the copied
    KV is the first sample's, and every page comes back."""
    s, pool = copying_scheduler(pages=40, page_size=4, slots=8, chunk=8)
    prompt = list(range(50, 50 + prompt_len))
    samples = [make_request(f"s{j}", prompt) for j in range(4)]
    other = make_request("other", list(range(100, 106)))
    for r in [*samples, other]:
        s.add(r)
    computed: dict[str, int] = {}
    for _ in range(5):
        plan = s.schedule()
        for c in plan.chunks:
            if c.start < len(c.request.prompt_ids):
                computed[c.request.request_id] = computed.get(c.request.request_id, 0) + c.length
                write_kv(pool, c.request, c.start, c.length)
        run_plan(plan)
        for c in plan.chunks:
            if c.start < len(c.request.prompt_ids):
                s.kv.publish_prompt(c.request, c.start + c.length)
    assert computed == {"s0": prompt_len, "other": 6, "s1": 1, "s2": 1, "s3": 1}
    assert [r.cached_len for r in samples] == [0] + [prompt_len - 1] * 3
    first = samples[0]
    for r in samples[1:]:
        for pos in range(prompt_len):
            page, off = r.pages[pos // 4], pos % 4
            assert pool.buffer[0, 1, page, off, 0, 0].item() == 1000 * pos + prompt[pos]
        assert r.pages[prompt_len // 4 if prompt_len % 4 else prompt_len // 4 - 1] not in first.pages
    for r in [*samples, other]:
        s.running.remove(r)
        s.kv.release(r)
    assert_all_back(kv=s.kv)
    assert all(not n.tails for n in [s.kv.prefix_cache.root, *s.kv.prefix_cache.leaves()])


def test_a_prompt_s_partial_last_page_stays_cached_after_its_request_and_a_failed_one_s_does_not() -> None:
    """Released normally, a computed prompt's partial last page stays in the prefix cache (a leaf no
    match takes) and a later same prompt copies it; released after a failure it is unlisted and
    freed, and the next one computes it again. Every page comes back."""
    s, _ = copying_scheduler(pages=20, page_size=4, slots=4, chunk=64)
    prompt = list(range(10, 16))  # one full page, a tail of 2

    def computed_by(rid: str, cache_prefix: bool = True) -> list[tuple[int, int]]:
        req = make_request(rid, prompt)
        s.add(req)
        plan = s.schedule()
        run_plan(plan)
        s.kv.publish_prompt(req, len(prompt))
        assert req.published_len == len(prompt)  # its tail is listed
        s.running.remove(req)
        s.kv.release(req, cache_prefix=cache_prefix)
        assert not s.kv.prefix_cache.root.children[tuple(prompt[:4])].tails
        return [(c.start, c.length) for c in plan.chunks]

    assert computed_by("first") == [(0, 6)]
    assert s.kv.usage().cached == 2  # the full page and the kept partial one
    assert computed_by("late") == [(5, 1)]  # the kept page, copied: only the last token runs
    assert s.kv.usage().cached == 2  # late's copy was not kept twice
    assert s.kv.prefix_cache.flush() == 2
    assert computed_by("failing", cache_prefix=False) == [(0, 6)]
    assert s.kv.usage().cached == 1  # its full page was published when computed; its tail page freed
    assert computed_by("after") == [(4, 2)]
    assert_all_back(kv=s.kv)
