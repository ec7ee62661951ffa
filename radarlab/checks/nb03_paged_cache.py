"""Checkers of notebook 03 (the paged KV cache): the slot mapping, the ref-counting allocator and
copy-on-write."""
from __future__ import annotations

from radarlab.checks.common import call_learner, verdict


def check_slot_mapping(slot_mapping) -> bool:
    """Check a learner's slot_mapping(block_table, block_size, start, n): the slots of positions
    start .. start+n-1 of a sequence whose logical block i lives in physical block block_table[i]."""
    from radarlab.kvcache.kv_cache_manager import KVCacheBlocks

    cases = [  # (description, block_table, block_size, start, n)
        ("block_table=[7], block_size=4, start=0, n=3 (one block)", [7], 4, 0, 3),
        ("block_table=[2, 5], block_size=4, start=0, n=6 (the 5th token starts block 5)", [2, 5], 4, 0, 6),
        ("block_table=[2, 5], block_size=4, start=5, n=1 (one decode step)", [2, 5], 4, 5, 1),
        ("block_table=[3, 0, 9], block_size=2, start=1, n=4 (blocks out of order)", [3, 0, 9], 2, 1, 4),
        ("block_table=[4, 1, 6], block_size=1, start=0, n=3 (block size 1: slot = block id)",
         [4, 1, 6], 1, 0, 3),
        ("block_table=[11, 3], block_size=16, start=14, n=4 (crossing a block boundary)", [11, 3], 16, 14, 4),
        ("block_table=[2], block_size=4, start=1, n=0 (no new tokens)", [2], 4, 1, 0),
    ]
    for description, table, bs, start, n in cases:
        want = KVCacheBlocks(bs, list(table), num_slots=start + n).slot_mapping(start, n)
        got, problem = call_learner(lambda: slot_mapping(list(table), bs, start, n), description)
        if problem:
            return verdict("slot_mapping", problem)
        try:
            got_list = [int(s) for s in got]
        except TypeError:
            return verdict("slot_mapping", f"for {description} it returned {got!r}; expected a list of ints "
                                           f"{want}")
        if got_list != want:
            positions = list(range(start, start + n))
            if got_list == positions:
                hint = (" (those are the positions; map each through its physical block, "
                        "block_table[p // block_size])")
            else:
                hint = " (slot = block_table[p // block_size] * block_size + p % block_size)"
            return verdict("slot_mapping", f"for {description} it returned {got_list}, expected {want}{hint}")
    return verdict("slot_mapping", None)


def check_ref_count_allocator(allocator_class) -> bool:
    """Check a learner's allocator class (free list + reference counts) against radarlab's BlockPool.

    The class takes num_blocks and has allocate() -> block id (the front of the free list, raising
    NoFreeBlocks when it is empty), incref(block_id) and free(block_id) (ValueError on a double free;
    a block whose count reaches 0 goes to the back of the free list). It exposes ref_counts (a list)
    and free_list (any sequence). After every step, return values, errors, counts and the free list
    must match the reference."""
    from radarlab.kvcache.block_pool import BlockPool, NoFreeBlocks

    name = "ref_count_allocator"
    steps = [  # (what, method, argument)
        ("allocate()", "allocate", None), ("allocate()", "allocate", None), ("allocate()", "allocate", None),
        ("incref(1) (a fork shares block 1)", "incref", 1),
        ("free(1) (one holder of the shared block lets go)", "free", 1),
        ("free(1) (the last holder lets go)", "free", 1),
        ("allocate()", "allocate", None),
        ("free(1) (block 1 is already free: a double free)", "free", 1),
        ("allocate()", "allocate", None),
        ("allocate() (the free list is empty)", "allocate", None),
        ("free(0)", "free", 0), ("free(2)", "free", 2), ("allocate()", "allocate", None),
    ]

    def run(obj, method, arg):
        try:
            out = getattr(obj, method)() if arg is None else getattr(obj, method)(arg)
        except NotImplementedError:
            raise
        except (NoFreeBlocks, ValueError) as err:
            return type(err).__name__
        return out

    def said(value):
        return f"raised {value}" if value in ("NoFreeBlocks", "ValueError") else f"returned {value!r}"

    def expected(value):
        return f"raise {value}" if value in ("NoFreeBlocks", "ValueError") else f"return {value!r}"

    ref = BlockPool(4, 1, enable_prefix_caching=False)
    try:
        mine = allocator_class(4)
    except NotImplementedError:
        return verdict(name, "the class is not written yet (it raises NotImplementedError)")
    except Exception as err:
        return verdict(name, f"creating it with num_blocks=4 raised {type(err).__name__}: {err}")
    history = []
    for what, method, arg in steps:
        where = f"after {', '.join(history)}" if history else "on a fresh pool of 4 blocks"
        want = run(ref, method, arg)
        try:
            got = run(mine, method, arg)
        except NotImplementedError:
            return verdict(name, f"{method} is not written yet (it raises NotImplementedError)")
        except Exception as err:  # a learner's bug should read as a counterexample, not a traceback
            return verdict(name, f"{where}, {what} raised {type(err).__name__}: {err}; expected it to "
                                 f"{expected(want)}")
        if hasattr(got, "__index__") and not isinstance(got, bool):
            got = int(got)  # a numpy or torch integer is as good as an int
        if got != want:
            return verdict(name, f"{where}, {what} {said(got)}; expected it to {expected(want)}")
        try:
            counts, free = [int(c) for c in mine.ref_counts], [int(b) for b in mine.free_list]
        except Exception as err:
            return verdict(name, f"reading ref_counts and free_list failed: {type(err).__name__}: {err}")
        if counts != ref.ref_counts:
            return verdict(name, f"{where}, {what}: ref_counts is {counts}, expected {ref.ref_counts}")
        if free != list(ref.free_block_ids):
            return verdict(name, f"{where}, {what}: free_list is {free}, expected {list(ref.free_block_ids)} "
                                 "(take from the front; a block whose count reaches 0 goes to the back)")
        history.append(what.split(" (")[0])
    return verdict(name, None)


def _cow_scenarios():
    """Scripts of (op, *args) for check_append_with_cow: hand-written ones first, each aimed at one rule,
    then random fork/append/free runs. Every ("append", name, n) step is checked."""
    import random

    fixed = [  # (block_size, num_blocks, script)
        (4, 8, [("allocate", "A", 3), ("append", "A", 1), ("append", "A", 1)]),
        (4, 8, [("allocate", "A", 6), ("fork", "A", "B"), ("append", "A", 1), ("append", "B", 1)]),
        (4, 8, [("allocate", "A", 8), ("fork", "A", "B"), ("append", "A", 1)]),
        (4, 8, [("allocate", "A", 6), ("fork", "A", "B"), ("append", "A", 7)]),
        (4, 4, [("allocate", "A", 6), ("fork", "A", "B"), ("allocate", "C", 4), ("append", "A", 3),
                ("append", "A", 2)]),
        (1, 6, [("allocate", "A", 3), ("fork", "A", "B"), ("append", "A", 1), ("append", "B", 2)]),
    ]
    rng = random.Random(9)
    randomised = []
    for _ in range(6):
        block_size = rng.choice([1, 2, 4])
        num_blocks = rng.randint(6, 16) // block_size + 4
        script, live, made = [("allocate", "s0", rng.randint(1, 2 * block_size))], ["s0"], 1
        for _ in range(14):
            roll = rng.random()
            if roll < 0.3 and len(live) < 4:
                child = f"s{made}"
                script.append(("fork", rng.choice(live), child))
                live.append(child)
                made += 1
            elif roll < 0.45 and len(live) > 1:
                gone = rng.choice(live)
                script.append(("free", gone))
                live.remove(gone)
            else:
                script.append(("append", rng.choice(live), rng.choice([1, 1, 1, 2, 3, block_size + 1])))
        randomised.append((block_size, num_blocks, script))
    return fixed + randomised


def check_append_with_cow(append_with_cow) -> bool:
    """Check a learner's append_with_cow(allocator, block_ids, num_slots, num_new, block_size) ->
    (block_ids, copies), the heart of KVCacheManager.allocate_slots without prefix caching.

    Scripts of allocate, fork, append and free run on radarlab's KVCacheManager. Before every
    append the learner's function gets a copy of the manager's allocator and of the sequence's block
    list; its answer must equal what allocate_slots then does: the same table, the same copy pairs,
    and the same ref counts and free list afterwards. When the pool is short it must raise
    NoFreeBlocks and leave both the list and the allocator as they were."""
    import copy

    from radarlab.kvcache.block_pool import NoFreeBlocks
    from radarlab.kvcache.kv_cache_manager import KVCacheManager
    from radarlab.kvcache.sequence import Sequence
    from radarlab.util import cdiv

    name = "append_with_cow"
    fixed_count = 6

    def blocks(n):
        return f"{n} block{'' if n == 1 else 's'}"

    for n, (bs, num_blocks, script) in enumerate(_cow_scenarios()):
        manager = KVCacheManager(num_blocks, bs, enable_prefix_caching=False)
        seqs = {}
        for op, *args in script:
            if op == "allocate":
                seqs[args[0]] = Sequence(args[0], [7] * args[1])
                manager.allocate(seqs[args[0]])
                continue
            if op == "fork":
                seqs[args[1]] = Sequence(args[1], list(seqs[args[0]].all_token_ids))
                manager.fork(seqs[args[0]], seqs[args[1]])
                continue
            if op == "free":
                manager.free(seqs.pop(args[0]))
                continue
            seq, num_new = seqs[args[0]], args[1]
            alloc = manager.block_pool
            table, num_slots = manager.get_block_table(seq), manager.num_slots(seq)
            free = alloc.num_free_blocks
            counts = [alloc.ref_count(b) for b in table]
            shared = num_slots % bs != 0 and counts[-1] > 1
            need = cdiv(num_slots + num_new, bs) - len(table) + int(shared)
            where = "" if n < fixed_count else "in a random run of allocate, fork, append and free: "
            state = (f"{where}a sequence with {num_slots} tokens in blocks {table} (block size {bs}, their "
                     f"ref counts {counts}), {blocks(free)} free, appending {num_new} "
                     f"token{'s' if num_new > 1 else ''}")
            mine, given = copy.deepcopy(alloc), list(table)
            before = (list(alloc.ref_counts), list(alloc.free_block_ids))
            try:
                got, raised = append_with_cow(mine, given, num_slots, num_new, bs), None
            except NotImplementedError:
                return verdict(name, "the function is not written yet (it raises NotImplementedError)")
            except NoFreeBlocks as err:
                got, raised = None, err
            except Exception as err:  # a learner's bug should read as a counterexample, not a traceback
                return verdict(name, f"for {state} it raised {type(err).__name__}: {err}")
            seq.append_token_ids([7] * num_new)
            try:
                want_copies = manager.allocate_slots(seq, num_new)
            except NoFreeBlocks:
                seq.truncate(seq.num_tokens - num_new)
                if raised is None:
                    return verdict(name, f"for {state} it returned {got!r}; it needs {blocks(need)} with "
                                         f"{free} free, so it should raise NoFreeBlocks")
                changed = [f"{what} {now} (before: {was})" for what, now, was in (
                    ("ref counts", list(mine.ref_counts), before[0]),
                    ("free list", list(mine.free_block_ids), before[1]),
                    ("block list", given, table)) if now != was]
                if changed:
                    return verdict(name, f"for {state} it raised NoFreeBlocks (right: it needs "
                                         f"{blocks(need)}) but changed things first: {'; '.join(changed)}. "
                                         f"Count what you need before taking any block")
                continue
            want_table = manager.get_block_table(seq)
            if raised is not None:
                return verdict(name, f"for {state} it raised NoFreeBlocks ({raised}), but it needs only "
                                     f"{blocks(need)} and {free} are free")
            try:
                got_table, got_copies = got
                got_table = [int(b) for b in got_table]
                got_copies = [tuple(int(b) for b in pair) for pair in got_copies]
            except (TypeError, ValueError):
                return verdict(name, f"for {state} it returned {got!r}; expected (block_ids, copies), here "
                                     f"({want_table}, {want_copies})")
            if got_copies != want_copies or got_table != want_table:
                if want_copies and not got_copies:
                    hint = (f"block {table[-1]} is partly filled and shared (ref count {counts[-1]}): take a "
                            f"private copy before writing into it")
                elif got_copies and not want_copies:
                    hint = (f"the last block is full ({num_slots} is a multiple of {bs}): the new tokens go "
                            f"into new blocks, so nothing needs copying" if num_slots % bs == 0 else
                            f"block {table[-1]} is not shared (ref count {counts[-1]}): write into it, no "
                            "copy")
                elif len(got_table) != len(want_table):
                    hint = (f"{num_slots} + {num_new} tokens need cdiv({num_slots + num_new}, {bs}) = "
                            f"{blocks(len(want_table))}")
                elif sorted(got_table) == sorted(want_table):
                    hint = "take the private copy first, then the new blocks"
                else:
                    hint = ("allocate with allocator.allocate() or allocate_many(n), which take the free "
                            "list in order")
                return verdict(name, f"for {state} it returned blocks {got_table} and copies {got_copies}; "
                                     f"expected {want_table} and {want_copies} ({hint})")
            if list(mine.ref_counts) != list(alloc.ref_counts):
                hint = " (after taking a private copy, let go of the shared block once: allocator.free)" \
                    if want_copies else ""
                return verdict(name, f"for {state} the ref counts became {mine.ref_counts}; expected "
                                     f"{alloc.ref_counts}{hint}")
            if list(mine.free_block_ids) != list(alloc.free_block_ids):
                return verdict(name, f"for {state} the free list became {list(mine.free_block_ids)}; "
                                     f"expected {list(alloc.free_block_ids)}")
    return verdict(name, None)


def _pool_script():
    """check_block_pool's hand-written script on a pool of 5 blocks: (call, args, the rule it tests).
    Hash names stand for real chain hashes; X is never cached."""
    return [
        ("allocate_many", (3,), "a fresh pool hands out blocks from the front of its free list"),
        ("cache_full_block", (0, "A"), "a full block is registered under its hash"),
        ("cache_full_block", (1, "B"), "a full block is registered under its hash"),
        ("cache_full_block", (2, "C"), "a full block is registered under its hash"),
        ("allocate", (), "the next fresh block"),
        ("cache_full_block", (3, "A"), "another block (0) already holds A: the first one stays the cached "
                                       "one, and this call returns False"),
        ("find_longest_cache_hit", (["A", "B", "C"],), "every hash of the chain is cached"),
        ("find_longest_cache_hit", (["A", "X", "C"],), "stop at the first miss: block i's hash names blocks "
                                                       "0..i, so nothing after a miss can be a prefix hit"),
        ("free", (3,), "a block that holds nothing cached goes back to the free list"),
        ("free", (2,), "a freed block that holds cached content stays findable (evictable) until it is "
                       "evicted"),
        ("free", (0,), "a freed block that holds cached content stays findable"),
        ("free", (1,), "a freed block that holds cached content stays findable"),
        ("free", (1,), "block 1's count is already 0: a double free raises ValueError"),
        ("incref", (0,), "a prefix-cache hit on a free cached block revives it: it leaves the evictable "
                         "set, so it is no longer free"),
        ("incref", (3,), "block 3 is free and holds nothing cached: incref raises ValueError (allocate it "
                         "instead)"),
        ("allocate_many", (2,), "never-cached free blocks go first; a cached block is evicted only when "
                                "none is left"),
        ("allocate", (), "with no never-cached block left, evict the least recently freed cached block "
                         "(2, freed before 1) and forget its hash"),
        ("allocate_many", (3,), "only 1 block is free: raise NoFreeBlocks before taking any (all or "
                                "nothing)"),
        ("allocate", (), "evict the last cached free block, 1, and forget its hash"),
        ("free", (0,), "block 0 still holds A: it becomes evictable again"),
        ("cache_full_block", (4, "B"), "B was forgotten when block 1 was evicted, so block 4 can hold it"),
    ]


def _pool_random_script(rng, num_blocks: int, hashes: dict, length: int) -> list[tuple]:
    """A random run of valid pool calls, planned on radarlab's BlockPool as it goes."""
    from radarlab.kvcache.block_pool import BlockPool

    plan, script, names = BlockPool(num_blocks, 4), [], sorted(hashes)
    for _ in range(length):
        held = [b for b in range(num_blocks) if plan.ref_counts[b] > 0]
        uncached_held = [b for b in held if plan.block_hashes[b] is None]
        roll = rng.random()
        if roll < 0.3 and plan.num_free_blocks:
            call = ("allocate_many", (rng.randint(1, min(3, plan.num_free_blocks)),))
        elif roll < 0.55 and held:
            call = ("free", (rng.choice(held),))
        elif roll < 0.7 and (held or plan.evictable):
            call = ("incref", (rng.choice(held + list(plan.evictable)),))
        elif roll < 0.85 and uncached_held:
            call = ("cache_full_block", (rng.choice(uncached_held), rng.choice(names)))
        else:
            call = ("find_longest_cache_hit", (rng.sample(names, rng.randint(1, 3)),))
        script.append((*call, None))
        _pool_call(plan, call[0], call[1], hashes)
    return script


def _pool_call(pool, method: str, args: tuple, hashes: dict):
    """Run one call with hash names turned into hashes; errors come back as their class name."""
    from radarlab.kvcache.block_pool import NoFreeBlocks

    real = tuple([hashes[a] for a in arg] if isinstance(arg, list) else hashes.get(arg, arg)
                 if isinstance(arg, str) else arg for arg in args)
    try:
        out = getattr(pool, method)(*real)
    except NotImplementedError:
        raise
    except (NoFreeBlocks, ValueError) as err:
        return type(err).__name__
    if isinstance(out, (list, tuple)):
        return [int(b) for b in out]
    return int(out) if hasattr(out, "__index__") and not isinstance(out, bool) else out


def _pool_state(pool, num_blocks: int, hashes: dict) -> dict:
    """What the KV cache manager can see of a pool: counts, free blocks, and where each hash is cached."""
    return {"ref_count per block": [int(pool.ref_count(b)) for b in range(num_blocks)],
            "num_free_blocks": int(pool.num_free_blocks),
            "cached": {name: [int(b) for b in pool.find_longest_cache_hit([h])]
                       for name, h in hashes.items()}}


def _describe_call(method: str, args: tuple) -> str:
    return f"{method}({', '.join(repr(a) if isinstance(a, list) else str(a) for a in args)})"


def check_block_pool(pool_cls) -> bool:
    """Check a learner's block pool class (BlockPool's allocate_many, incref, free,
    find_longest_cache_hit and cache_full_block) against radarlab's BlockPool.

    A hand-written script where each call tests one rule, then random runs, then a prefix-cached
    workload through KVCacheManager(block_pool_cls=pool_cls). After every call the return value (or
    the error), the ref counts, the number of free blocks and where each hash is found must match."""
    import random

    from radarlab.kvcache.block_pool import BlockPool, hash_block_tokens

    name = "block_pool"
    hashes = {n: hash_block_tokens(None, [ord(n)]) for n in "ABCDEFX"}
    rng = random.Random(3)
    runs = [("", 5, _pool_script())]
    runs += [("in a random run of pool calls: ", 8, _pool_random_script(rng, 8, hashes, 60))
             for _ in range(4)]
    for where, num_blocks, script in runs:
        ref = BlockPool(num_blocks, 4)
        try:
            mine = pool_cls(num_blocks, 4, True)
        except NotImplementedError:
            return verdict(name, "the class is not written yet (it raises NotImplementedError)")
        except Exception as err:
            return verdict(name, f"creating it as pool_cls(num_blocks={num_blocks}, block_size=4, "
                                 f"enable_prefix_caching=True) raised {type(err).__name__}: {err}")
        history: list[str] = []
        for method, args, rule in script:
            want = _pool_call(ref, method, args, hashes)
            call = _describe_call(method, args)
            shown = ", ".join(history[-6:])
            before = (f"after {'... ' if len(history) > 6 else ''}{shown}" if history
                      else f"on a fresh pool of {num_blocks} blocks")
            try:
                got = _pool_call(mine, method, args, hashes)
            except NotImplementedError:
                return verdict(name, f"{method} is not written yet (it raises NotImplementedError)")
            except Exception as err:  # a learner's bug should read as a counterexample, not a traceback
                return verdict(name, f"{where}{before}: {call} raised {type(err).__name__}: {err}; expected "
                                     f"{_said(want)}")
            hint = f" ({rule})" if rule else ""
            if got != want:
                return verdict(name, f"{where}{before}: {call} {_said(got, past=True)}, expected "
                                     f"{_said(want)}{hint}")
            got_state, want_state = (_pool_state(p, num_blocks, hashes) for p in (mine, ref))
            for what in want_state:
                if got_state[what] != want_state[what]:
                    shown = got_state[what], want_state[what]
                    if what == "cached":  # only the hashes that differ
                        diff = [h for h in want_state[what] if got_state[what][h] != want_state[what][h]]
                        shown = tuple({h: s[what][h] for h in diff} for s in (got_state, want_state))
                        what = "find_longest_cache_hit([h]) per hash"
                    return verdict(name, f"{where}{before}, then {call}: {what} is {shown[0]}, expected "
                                         f"{shown[1]}{hint}")
            history.append(call)
    problem = _check_pool_in_manager(pool_cls)
    return verdict(name, problem)


def _said(value, past: bool = False) -> str:
    if value in ("NoFreeBlocks", "ValueError"):
        return f"{'raised' if past else 'to raise'} {value}"
    return f"{'returned' if past else ''} {value!r}".strip()


def _check_pool_in_manager(pool_cls) -> str | None:
    """Requests with shared prefixes served one after another through KVCacheManager on the learner's
    pool and on BlockPool, in a pool small enough to evict: the same block tables and hit counts."""
    import random

    from radarlab.kvcache.block_pool import BlockPool, NoFreeBlocks
    from radarlab.kvcache.kv_cache_manager import KVCacheManager
    from radarlab.kvcache.sequence import Sequence

    rng = random.Random(5)
    prefixes = [[rng.randrange(100, 999) for _ in range(12)] for _ in range(4)]
    managers = [KVCacheManager(14, 4, block_pool_cls=cls) for cls in (BlockPool, pool_cls)]
    live: list[str] = []
    for i in range(40):
        prompt = rng.choice(prefixes)[:rng.randint(4, 12)] + [rng.randrange(100, 999) for _ in range(3)]
        seq_id = f"r{i}"
        tables = []
        for m in managers:
            try:
                m.allocate(Sequence(seq_id, prompt))
                tables.append(m.get_block_table(seq_id))
            except NoFreeBlocks:
                tables.append("NoFreeBlocks")
        if tables[0] != tables[1]:
            return (f"on KVCacheManager(14 blocks of 4) with your pool, request {i} of a prefix-sharing "
                    f"workload got block table {tables[1]}, BlockPool gives {tables[0]}")
        if tables[0] != "NoFreeBlocks":
            live.append(seq_id)
        while len(live) > 2 or (live and rng.random() < 0.4):
            gone = live.pop(0)
            for m in managers:
                m.free(gone)
    stats = [(m.prefix_cache_stats.queries, m.prefix_cache_stats.hits) for m in managers]
    if stats[0] != stats[1]:
        return (f"on KVCacheManager with your pool, a prefix-sharing workload counted (queries, hits) = "
                f"{stats[1]}, BlockPool {stats[0]}")
    return None

