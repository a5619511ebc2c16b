"""The engine's prefix cache (issue 23, item 2) on the host driver's VmmArena (CI's stand-in for the
CUDA one: the same share, refcount and unmap paths): requests that start with cached blocks map the
store's granules into their slots and prefill only the rest; greedy tokens equal the cache off and
Generator alone; a request that diverges after a shared block never changes another's tokens; a slot
mapping a shared block reads the writer's values; unused blocks are evicted under memory pressure
(partial blocks first, then least recently used); after close every handle is released and the fault
counters are zero."""

import numpy as np
import pytest
from arena_checks import close_and_check

from jax_kv.engine import FINISH_LENGTH, Engine
from jax_kv.memory import EagerArena, host_arena

MAX_LEN = 256
BLOCK = 16  # tokens per block: one 8 KiB granule of the tiny model's 512-byte tokens


@pytest.fixture
def arenas():
    made = []

    def make():
        a = host_arena(reserve_bytes=1 << 30, granule=BLOCK * 512)
        made.append(a)
        return a

    yield make
    for a in made:
        close_and_check(a)


def engine(model, arena, **kw):
    kw.setdefault("max_slots", 4)
    kw.setdefault("max_len", MAX_LEN)
    kw.setdefault("prefill_chunk_tokens", 64)
    return Engine(model, arena=arena, **kw)


def run(eng, waves):
    """Submits each wave of (prompt, n) after the previous wave's first step; checks the
    memory invariant after every step -> the requests."""
    reqs = []
    for wave in waves:
        reqs += [eng.submit(p, n, stop_token_ids=[]) for p, n in wave]
        eng.step()
        eng.check_memory()
    while eng.has_work():
        eng.step()
        eng.check_memory()
    return [r.result() for r in reqs]


def shared_prefix_workload(rng, model, groups=3, per_group=4):
    vocab = model.config.vocab_size
    waves = []
    for _ in range(groups):
        prefix = [int(t) for t in rng.integers(3, vocab, 2 * BLOCK + 8)]  # 2.5 blocks
        wave = []
        for _ in range(per_group):
            q = [int(t) for t in rng.integers(3, vocab, int(rng.integers(1, 20)))]
            wave.append((prefix + q, int(rng.integers(1, 24))))
        waves += [wave[:1], wave[1:]]  # the first of a group runs ahead, the rest hit it
    return waves


def run_groups(eng, waves):
    """Each group's first request runs until its prompt is prefilled (its blocks cached),
    then the group's others are submitted: every follower can hit, whatever the slots'
    timing. -> the requests' completions."""
    reqs = []
    for first, rest in zip(waves[::2], waves[1::2], strict=True):
        head = [eng.submit(p, n, stop_token_ids=[]) for p, n in first]
        while not head[0].streamed:
            eng.step()
            eng.check_memory()
        reqs += head + [eng.submit(p, n, stop_token_ids=[]) for p, n in rest]
    while eng.has_work():
        eng.step()
        eng.check_memory()
    return [r.result() for r in reqs]


def test_shared_prefixes_are_prefilled_once_and_tokens_are_unchanged(model, generator, rng,
                                                                      arenas):  # fmt: skip
    waves = shared_prefix_workload(rng, model)
    with engine(model, arenas()) as on:
        assert on.prefix is not None and on.cache.block_tokens == BLOCK
        got_on = run_groups(on, waves)
        stats_on, prefix = on.stats, on.prefix.stats
    with engine(model, arenas(), prefix_cache=False) as off:
        assert off.prefix is None
        got_off = run_groups(off, waves)
        stats_off = off.stats
    flat = [x for wave in waves for x in wave]
    for (p, n), a, b in zip(flat, got_on, got_off, strict=True):
        assert a.tokens == b.tokens == generator.generate([p], n, stop_tokens=[]).tokens[0]
        assert a.finish_reason == FINISH_LENGTH
    # 3 groups x 3 followers hit the 2 full blocks of their group's prefix.
    assert prefix.hit_tokens == 3 * 3 * 2 * BLOCK
    assert stats_on.prefill_tokens == stats_off.prefill_tokens - prefix.hit_tokens
    assert prefix.cached_blocks >= 3 * 2


def test_a_diverging_request_never_changes_a_sharer(model, generator, rng, arenas):
    """A and B share two blocks and run together (B maps A's blocks while A still runs);
    each writes its own tail; both equal their solo runs. B's slot reads A's values in the
    shared blocks (through the same granules)."""
    vocab = model.config.vocab_size
    prefix = [int(t) for t in rng.integers(3, vocab, 2 * BLOCK)]
    a_prompt = prefix + [int(t) for t in rng.integers(3, vocab, 5)]
    b_prompt = prefix + [int(t) for t in rng.integers(3, vocab, 9)]
    with engine(model, arenas()) as eng:
        a = eng.submit(a_prompt, 40, stop_token_ids=[])
        eng.step()  # A prefilled: its two prefix blocks are cached (A owns them)
        b = eng.submit(b_prompt, 30, stop_token_ids=[])
        eng.step()
        sa = next(i for i, s in enumerate(eng._slots) if s and s.request is a)
        sb = next(i for i, s in enumerate(eng._slots) if s and s.request is b)
        assert len(eng.cache.slot_shared[sb]) == 2
        ka = np.array(eng.cache.k[0][sa, : 2 * BLOCK])
        kb = np.array(eng.cache.k[0][sb, : 2 * BLOCK])
        assert np.abs(ka).sum() > 0 and np.array_equal(ka, kb)
        while eng.has_work():
            eng.step()
            eng.check_memory()
        assert eng.prefix.stats.hit_tokens == 2 * BLOCK
        c = eng.submit(prefix + [7], 5, stop_token_ids=[])  # after both ended: ownerless hit
        eng.run_until_idle()
        assert eng.prefix.stats.hit_tokens == 4 * BLOCK
    assert a.result().tokens == generator.generate([a_prompt], 40, stop_tokens=[]).tokens[0]
    assert b.result().tokens == generator.generate([b_prompt], 30, stop_tokens=[]).tokens[0]
    want = generator.generate([prefix + [7]], 5, stop_tokens=[]).tokens[0]
    assert c.result().tokens == want


def test_unused_blocks_are_evicted_under_memory_pressure(model, generator, rng, arenas):
    """A budget of 24 granules per binding, 12 requests of distinct 3-block prompts: the
    cache fills, least recently used blocks no slot maps are evicted to admit new requests,
    tokens are unchanged, the memory bound holds after every step."""
    vocab = model.config.vocab_size
    bindings = 2 * model.config.num_layers
    budget = 24 * BLOCK * 512 * bindings
    prompts = [[int(t) for t in rng.integers(3, vocab, 3 * BLOCK + 2)] for _ in range(12)]
    with engine(model, arenas(), max_slots=2, kv_budget_bytes=budget) as eng:
        got = run(eng, [[(p, 12)] for p in prompts])
        assert eng.prefix.stats.evicted_blocks > 0
        assert eng.cache.held_bytes <= budget
        # Re-submitting the last prompt hits its blocks (most recently used: not evicted).
        again = eng.submit(prompts[-1], 12, stop_token_ids=[])
        hits = eng.prefix.stats.hit_tokens
        eng.run_until_idle()
        assert eng.prefix.stats.hit_tokens == hits + 3 * BLOCK
    for p, c in zip(prompts, got, strict=True):
        assert c.tokens == generator.generate([p], 12, stop_tokens=[]).tokens[0]
    assert again.result().tokens == got[-1].tokens


def test_prefix_cache_bytes_caps_the_blocks_no_request_maps(model, generator, rng, arenas):
    """prefix_cache_bytes: after every request's end the blocks no running request maps hold at most
    the cap (partial blocks, then least recently used ones, evicted first); 0 keeps none, so
    committed memory follows the running requests alone; tokens are unchanged; a cap of two blocks
    still serves the most recent prompt's blocks."""
    vocab = model.config.vocab_size
    bindings = 2 * model.config.num_layers
    block_bytes = BLOCK * 512 * bindings
    prompts = [[int(t) for t in rng.integers(3, vocab, 3 * BLOCK + 2)] for _ in range(6)]
    for cap in (0, 2 * block_bytes):
        with engine(model, arenas(), max_slots=2, prefix_cache_bytes=cap) as eng:
            reqs = []
            for p in prompts:
                reqs.append(eng.submit(p, 12, stop_token_ids=[]))
                eng.step()
                assert eng.cache.cached_only_bytes <= cap
            while eng.has_work():
                eng.step()
                eng.check_memory()
                assert eng.cache.cached_only_bytes <= cap
            assert eng.prefix.stats.evicted_blocks > 0
            if cap == 0:
                assert eng.cache.committed_bytes == 0  # nothing running, nothing kept
            again = eng.submit(prompts[-1], 12, stop_token_ids=[])
            hits = eng.prefix.stats.hit_tokens
            eng.run_until_idle()
            # The last prompt's first two blocks are the most recently used ones.
            assert eng.prefix.stats.hit_tokens - hits == (0 if cap == 0 else 2 * BLOCK)
        for p, r in zip(prompts, reqs, strict=True):
            assert r.result().tokens == generator.generate([p], 12, stop_tokens=[]).tokens[0]
        assert again.result().tokens == reqs[-1].result().tokens
    with pytest.raises(ValueError, match="prefix_cache_bytes"):
        engine(model, arenas(), prefix_cache_bytes=-1)


def test_prefix_cache_bytes_counts_the_shared_blocks_running_requests_map(
    model, generator, rng, arenas
):
    """prefix_cache_bytes caps every block of the prefix store, the ones running requests map
    from it and the full blocks they wrote included: while a request maps a cached prompt's 2
    blocks (cap 2 blocks), another request's end leaves none of its blocks cached, so
    committed KV stays within the cap + the running requests' granules outside full blocks +
    the floor. (Counting only the blocks no request maps, as before, kept the ended request's
    2 blocks beside the 2 mapped ones: 2x the cap.) The store passes the cap only with
    nothing left to evict, at every step; tokens equal Generator's."""
    vocab = model.config.vocab_size
    block_bytes = BLOCK * 512 * 2 * model.config.num_layers
    cap = 2 * block_bytes
    system, other = ([int(t) for t in rng.integers(3, vocab, 2 * BLOCK + 4)] for _ in range(2))
    follower = system[: 2 * BLOCK] + [int(t) for t in rng.integers(3, vocab, 6)]
    with engine(model, arenas(), max_slots=2, prefix_cache_bytes=cap) as eng:

        def step_and_check():
            eng.step()
            eng.check_memory()
            c = eng.cache
            assert c.store_bytes <= cap or c.cached_only_bytes == 0

        first = eng.submit(system, 4, stop_token_ids=[])
        while eng.has_work():
            step_and_check()
        assert eng.cache.cached_only_bytes == cap  # its 2 full blocks; its partial evicted
        hits = eng.prefix.stats.hit_tokens
        long = eng.submit(follower, 40, stop_token_ids=[])
        short = eng.submit(other, 4, stop_token_ids=[])
        while not short.done:
            step_and_check()
        assert eng.prefix.stats.hit_tokens - hits == 2 * BLOCK  # long maps system's blocks
        assert not long.done
        assert eng.cache.cached_only_bytes == 0  # short's blocks evicted: the cap is full
        while eng.has_work():
            step_and_check()
    for p, n, r in zip((system, follower, other), (4, 40, 4), (first, long, short), strict=True):
        assert r.result().tokens == generator.generate([p], n, stop_tokens=[]).tokens[0]


def test_a_request_ending_on_a_block_boundary_is_trimmed_at_its_end(model, rng, arenas):
    """A request that ends on a block boundary caches no partial block; its full block is
    evictable from its end (its slot retiring), so prefix_cache_bytes=0 holds at that step,
    not only once the slot is released (found in review)."""
    prompt = [int(t) for t in rng.integers(3, model.config.vocab_size, BLOCK)]
    with engine(model, arenas(), max_slots=2, prefix_cache_bytes=0) as eng:
        req = eng.submit(prompt, 1, stop_token_ids=[])
        eng.step()
        assert req.done and eng._retiring  # ended, its slot not yet released
        assert eng.cache.store_bytes == 0
        eng.run_until_idle()
        assert eng.cache.store_bytes == 0


@pytest.mark.parametrize("cap_blocks", [0, 1])
def test_a_cap_never_cuts_off_a_running_requests_blocks(model, rng, arenas, cap_blocks):
    """Two requests prefill the same first block in one call: the first's is cached, the
    second finds it equal and writes its next blocks as that block's children. When the
    first ends, its block is evictable but has the running request's blocks below it: the
    cap must not drop it (that cut the running request's blocks off from every lookup; at a
    1-block cap the store emptied, found in review). A third request sharing the running
    one's first 2 blocks hits both."""
    vocab = model.config.vocab_size
    shared = [int(t) for t in rng.integers(3, vocab, BLOCK)]
    first = shared + [int(t) for t in rng.integers(3, vocab, 4)]
    running = shared + [int(t) for t in rng.integers(3, vocab, BLOCK + 4)]
    block_bytes = BLOCK * 512 * 2 * model.config.num_layers
    with engine(model, arenas(), max_slots=3, prefix_cache_bytes=cap_blocks * block_bytes,
                decode_ahead=False) as eng:  # fmt: skip
        a = eng.submit(first, 2, stop_token_ids=[])
        b = eng.submit(running, 40, stop_token_ids=[])
        while not a.done or len(next(s for s in eng._active() if s.request is b).blocks) < 3:
            eng.step()
            eng.check_memory()
        hits = eng.prefix.stats.hit_tokens
        c = eng.submit(running[: 2 * BLOCK] + [int(t) for t in rng.integers(3, vocab, 5)], 2,
                       stop_token_ids=[])  # fmt: skip
        while not c.done:
            eng.step()
        assert not b.done
        assert eng.prefix.stats.hit_tokens - hits == 2 * BLOCK
        eng.run_until_idle()


def test_partial_blocks_are_evicted_before_a_shared_prefix(model, generator, rng, arenas):
    """Under the cap (5 blocks, a running request's own full blocks counted), the blocks
    requests ended in (partial) go before full blocks, even more recently used ones: a system
    prompt (2 blocks) outlives two other requests' tails and a later request of its group hits
    both of its blocks. In plain LRU order the first tail goes, then, when the third request
    writes its block, the prompt's second block (a leaf older than the second request's)."""
    vocab = model.config.vocab_size
    block_bytes = BLOCK * 512 * 2 * model.config.num_layers
    cap = 5 * block_bytes
    system = [int(t) for t in rng.integers(3, vocab, 2 * BLOCK)]
    others = [[int(t) for t in rng.integers(3, vocab, BLOCK + 4)] for _ in range(2)]  # 1 + a tail
    first, last = (system + [int(t) for t in rng.integers(3, vocab, 4)] for _ in range(2))
    with engine(model, arenas(), max_slots=2, prefix_cache_bytes=cap) as eng:
        reqs = []
        for p in (first, *others):
            reqs.append(eng.submit(p, 4, stop_token_ids=[]))
            eng.run_until_idle()
            eng.check_memory()
            assert eng.cache.store_bytes <= cap
        assert eng.prefix.stats.evicted_blocks >= 2
        hits = eng.prefix.stats.hit_tokens
        reqs.append(eng.submit(last, 4, stop_token_ids=[]))
        eng.run_until_idle()
        assert eng.prefix.stats.hit_tokens - hits == 2 * BLOCK
    for p, r in zip((first, *others, last), reqs, strict=True):
        assert r.result().tokens == generator.generate([p], 4, stop_tokens=[]).tokens[0]


@pytest.mark.parametrize("cap_blocks", [0, 2])
def test_a_chat_turn_admitted_as_ended_requests_release_its_blocks(
    model, generator, rng, arenas, cap_blocks
):
    """A chat turn whose partial block's copy does not fit makes admission release the ended
    requests' slots first; that release trims the cache to its cap and may drop the very
    blocks the turn looked up (found in review: the turn then mapped a dropped store block,
    KeyError). The turn must look up again; its tokens equal Generator's. Cap 2 blocks: the
    turn continues an older chat while another request's slot is being released; cap 0: it
    continues the request whose slot is being released."""
    vocab = model.config.vocab_size
    block = BLOCK * 512 * 2 * model.config.num_layers
    first = [int(t) for t in rng.integers(3, vocab, BLOCK + 4)]
    budget = (5 if cap_blocks else 3) * block
    with engine(model, arenas(), max_slots=2, kv_budget_bytes=budget,
                prefix_cache_bytes=cap_blocks * block) as eng:  # fmt: skip
        a = eng.submit(first, 3 if cap_blocks else 20, stop_token_ids=[])
        if cap_blocks:  # a ends; another request runs and ends
            eng.run_until_idle()
            other = eng.submit([int(t) for t in rng.integers(3, vocab, 2 * BLOCK + 8)], 8,
                               stop_token_ids=[])  # fmt: skip
            ending = other
        else:
            ending = a
        while not ending.done:
            eng.step()
        assert eng._retiring  # the ended slot is released by the next step's admission
        turn = first + a.result().tokens + [7]
        c = eng.submit(turn, 4, stop_token_ids=[])
        while eng.has_work():
            eng.step()
            eng.check_memory()
    assert c.result().tokens == generator.generate([turn], 4, stop_tokens=[]).tokens[0]


def test_cancel_and_preempt_while_blocks_are_shared(model, generator, rng, arenas):
    vocab = model.config.vocab_size
    prefix = [int(t) for t in rng.integers(3, vocab, 2 * BLOCK)]
    prompts = [prefix + [int(t) for t in rng.integers(3, vocab, 4)] for _ in range(5)]
    bindings = 2 * model.config.num_layers
    budget = 14 * BLOCK * 512 * bindings  # tight: forces preemption while sharing
    with engine(model, arenas(), max_slots=4, kv_budget_bytes=budget) as eng:
        reqs = [eng.submit(prompts[0], 60, stop_token_ids=[])]
        eng.step()
        reqs += [eng.submit(p, 60, stop_token_ids=[]) for p in prompts[1:]]
        eng.step()
        reqs[2].cancel()
        while eng.has_work():
            eng.step()
            eng.check_memory()
        assert eng.stats.preemptions > 0
    for i, (p, r) in enumerate(zip(prompts, reqs, strict=True)):
        c = r.completion
        if i == 2:
            assert c.finish_reason == "cancelled"
            continue
        assert c.tokens == generator.generate([p], 60, stop_tokens=[]).tokens[0], i


def test_prefix_cache_needs_a_vmm_arena(model):
    with pytest.raises(ValueError, match=r"prefix_cache: sharing granules .* needs a VmmArena"):
        Engine(model, arena=EagerArena(), max_len=MAX_LEN, prefix_cache=True)


def test_a_chat_turn_continues_the_previous_partial_block_by_copy_on_write(
    model, generator, rng, arenas
):
    """Each turn resubmits the whole history (prompt + answer + a new message). The previous
    turn's full blocks are mapped; the block it ended in, partly filled, is mapped and copied
    on write (one granule per binding), so a turn prefills only the last answer token and the
    new message; tokens equal the history generated alone."""
    vocab = model.config.vocab_size
    arena = arenas()
    history = [int(t) for t in rng.integers(3, vocab, 21)]
    with engine(model, arena) as eng:
        bindings = eng.cache.bindings
        for turn in range(4):
            prefilled = eng.stats.prefill_tokens
            cow = arena.stats().cow_copies
            r = eng.submit(history, 10, stop_token_ids=[])
            eng.run_until_idle()
            eng.check_memory()
            c = r.result()
            assert c.tokens == generator.generate([history], 10, stop_tokens=[]).tokens[0]
            if turn:
                # Only the last answer token (never written: it was the last one sampled)
                # and the new message were computed.
                assert eng.stats.prefill_tokens - prefilled == 1 + 5
                assert arena.stats().cow_copies - cow == bindings * eng.cache.block_granules
            message = [int(t) for t in rng.integers(3, vocab, 5)]
            history = history + c.tokens + message
        assert eng.prefix.stats.partial_hits == 3


def test_a_turn_submitted_as_the_last_one_ends_maps_its_partial_block(
    model, generator, rng, arenas
):
    """The block a request ends in is cached when it ends, not when its slot is released
    (beside the next call): a continuation submitted at once, admitted in the next step, maps
    it. (Found by review: caching it at the release missed this hit, 18 of 34 tokens
    prefilled instead of 4.)"""
    vocab = model.config.vocab_size
    first = [int(t) for t in rng.integers(3, vocab, 21)]
    with engine(model, arenas()) as eng:
        a = eng.submit(first, 10, stop_token_ids=[])
        while not a.done:
            eng.step()
        assert eng._retiring  # its slot is still to be released
        history = first + a.result().tokens + [int(t) for t in rng.integers(3, vocab, 3)]
        prefilled = eng.stats.prefill_tokens
        b = eng.submit(history, 5, stop_token_ids=[])
        eng.run_until_idle()
        assert eng.prefix.stats.partial_hits == 1
        assert eng.stats.prefill_tokens - prefilled == 1 + 3
    assert b.result().tokens == generator.generate([history], 5, stop_tokens=[]).tokens[0]


def test_a_partial_block_copy_that_would_pass_the_budget_is_prefilled_instead(
    model, generator, arenas
):
    """A chat continuation's partial block is a private copy (a block of new granules per
    binding): it counts against kv_budget_bytes like any commit. A (20 tokens + 3) ends with 2
    cached blocks; B then fills the budget (5 blocks); C continues A's chat. Its copy would make
    6 blocks held, so C prefills those tokens instead (the copy skipped: no partial hit); the
    budget holds after every step and the tokens equal Generator alone. (Found by randomized
    schedules: the copy was never checked, and C's first piece fitted the copied granule.)"""
    bindings = 2 * model.config.num_layers
    block = BLOCK * 512 * bindings
    rng = np.random.default_rng(0)
    vocab = model.config.vocab_size
    a_prompt = [int(t) for t in rng.integers(3, vocab, 20)]
    b_prompt = [int(t) for t in rng.integers(3, vocab, 40)]
    with engine(model, arenas(), max_slots=2, kv_budget_bytes=5 * block) as eng:
        a = eng.submit(a_prompt, 3, stop_token_ids=[])
        eng.run_until_idle()
        assert eng.cache.cached_only_bytes == 2 * block
        b = eng.submit(b_prompt, 8, stop_token_ids=[])
        eng.step()
        assert eng.cache.held_bytes == 5 * block
        c_prompt = a_prompt + a.result().tokens + [7]
        c = eng.submit(c_prompt, 4, stop_token_ids=[])
        while eng.has_work():
            eng.step()
            eng.check_memory()
            assert eng.cache.held_bytes <= 5 * block
        assert eng.prefix.stats.partial_hits == 0
        for r, p, n in ((b, b_prompt, 8), (c, c_prompt, 4)):
            assert r.result().tokens == generator.generate([p], n, stop_tokens=[]).tokens[0]


def test_hits_count_only_what_an_admission_used(model, arenas):
    """hit_tokens are prompt tokens the cache spared the prefill: with no preemption, every
    prompt token is prefilled or spared once. C starts with A's 2 cached blocks but waits for
    memory behind B, and A's blocks are evicted meanwhile: C prefills all its tokens. The
    lookups of the steps it waited were counted as hits (768 tokens spared of 0)."""
    bindings = 2 * model.config.num_layers
    rng = np.random.default_rng(0)
    vocab = model.config.vocab_size
    a_prompt = [int(t) for t in rng.integers(3, vocab, 32)]
    b_prompt = [int(t) for t in rng.integers(3, vocab, 40)]
    c_prompt = a_prompt + list(range(3, 40))
    budget = 6 * BLOCK * 512 * bindings
    with engine(model, arenas(), max_slots=2, kv_budget_bytes=budget) as eng:
        eng.submit(a_prompt, 1, stop_token_ids=[])
        eng.run_until_idle()
        eng.submit(b_prompt, 40, stop_token_ids=[])
        eng.step()
        eng.submit(c_prompt, 5, stop_token_ids=[])
        while eng.has_work():
            eng.step()
            eng.check_memory()
        assert eng.stats.preemptions == 0
        prompts = len(a_prompt) + len(b_prompt) + len(c_prompt)
        s = eng.prefix.stats
        assert eng.stats.prefill_tokens + s.hit_tokens == prompts, s
        assert s.lookups == 3  # one per admission
