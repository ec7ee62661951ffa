"""Exercise checkers. Each runs a learner's function on cases with known answers and prints one line:
a pass, or the first counterexample in plain words. They return True or False so tests can use them.
"""
from __future__ import annotations

from collections.abc import Callable


def verdict(exercise: str, counterexample: str | None) -> bool:
    """Print the one-line result of a checker."""
    if counterexample is None:
        print(f"PASS {exercise}")
        return True
    print(f"FAIL {exercise}: {counterexample}")
    return False


def learner_or_reference(name: str, learner, passed: bool, reference):
    """What the cells after an exercise use: the learner's code if it passed its checker, otherwise
    radarlab's reference, said in one line, so a skipped exercise never breaks the rest."""
    if passed:
        return learner
    print(f"the cells below use radarlab's {reference.__module__}.{reference.__qualname__} in place of your {name}")
    return reference


def call_learner(thunk: Callable[[], object], description: str) -> tuple[object, str | None]:
    """Run a learner's code: (result, None), or (None, a plain-words problem) when it is not written
    yet or crashes, so that a learner's bug reads as a counterexample rather than a traceback."""
    try:
        return thunk(), None
    except NotImplementedError:
        return None, "the function is not written yet (it raises NotImplementedError)"
    except Exception as err:
        return None, f"for {description} it raised {type(err).__name__}: {err}"


# --- notebook 00: rms_norm ---------------------------------------------------------------------

def _first_tensor_difference(got, want, atol: float, rtol: float) -> str | None:
    """Describe how a returned tensor differs from the expected one (type, shape, dtype, then values)."""
    import torch

    if not isinstance(got, torch.Tensor):
        return f"a {type(got).__name__}, not a tensor"
    if tuple(got.shape) != tuple(want.shape):
        return f"shape {tuple(got.shape)}, expected {tuple(want.shape)}"
    if got.dtype != want.dtype:
        return f"dtype {got.dtype}, expected {want.dtype} (the input's dtype)"
    g, w = got.detach().float().cpu(), want.float()
    bad = ~torch.isclose(g, w, atol=atol, rtol=rtol)
    if not bad.any():
        return None
    idx = tuple(int(i) for i in bad.nonzero()[0])
    return f"{g[idx].item():.6g} at index {idx}, expected {w[idx].item():.6g}"


def check_rms_norm(rms_norm) -> bool:
    """Check a learner's rms_norm(x, weight, eps) against the course model's RMSNorm.

    The cases start small enough to work by hand, then cover what trips people up: the weight, the
    eps inside the square root, a row of zeros, more than two dimensions, and bf16 inputs (the
    mean must be taken in fp32 and the result returned in the input's dtype)."""
    import torch

    from radarlab.models.llama import RMSNorm

    gen = torch.Generator().manual_seed(0)
    ones4 = torch.ones(4)
    cases = [
        ("x=[[1, 2, 3, 4]], weight all ones, eps=0", torch.tensor([[1.0, 2.0, 3.0, 4.0]]), ones4, 0.0),
        ("x=[[1, 2, 3, 4]], weight=[2, 0.5, 1, -1], eps=0",
         torch.tensor([[1.0, 2.0, 3.0, 4.0]]), torch.tensor([2.0, 0.5, 1.0, -1.0]), 0.0),
        ("x=[[1, 1, 1, 1]], weight all ones, eps=1 (eps goes inside the square root)",
         torch.ones(1, 4), ones4, 1.0),
        ("a row of zeros, eps=1e-6 (the answer is zeros, not NaN)", torch.zeros(2, 4), ones4, 1e-6),
        ("random x of shape (3, 576) and random weight, eps=1e-5",
         torch.randn(3, 576, generator=gen), torch.randn(576, generator=gen), 1e-5),
        ("random x of shape (2, 3, 8) (normalize over the last dimension only), eps=1e-5",
         torch.randn(2, 3, 8, generator=gen), torch.randn(8, generator=gen), 1e-5),
        ("random bfloat16 x of shape (2, 64) times 100 and bfloat16 weight, eps=1e-5",
         (torch.randn(2, 64, generator=gen) * 100).bfloat16(), torch.randn(64, generator=gen).bfloat16(), 1e-5),
    ]
    for description, x, weight, eps in cases:
        ref = RMSNorm(x.shape[-1], eps).to(weight.dtype)
        with torch.no_grad():
            ref.weight.copy_(weight)
            want = ref(x)
        loose = x.dtype == torch.bfloat16
        x_in, w_in = x.clone(), weight.clone()
        got, problem = call_learner(lambda: rms_norm(x_in, w_in, eps), description)
        if problem:
            return verdict("rms_norm", problem)
        if not (torch.equal(x_in, x) and torch.equal(w_in, weight)):
            return verdict("rms_norm", f"for {description} it changed its input in place; return a new tensor")
        problem = _first_tensor_difference(got, want, atol=1e-2 if loose else 1e-5, rtol=1e-2 if loose else 1e-5)
        if problem:
            return verdict("rms_norm", f"for {description} it returned {problem}")
    return verdict("rms_norm", None)


# --- notebook 01: KV-cache arithmetic -------------------------------------------------------------

def check_kv_bytes_per_token(kv_bytes_per_token) -> bool:
    """Check a learner's kv_bytes_per_token(layers, kv_heads, head_dim, bytes_per_value) against the
    calculator in radarlab.kvcache.memory, starting from the article's 80-layer model."""
    import math

    from radarlab.kvcache.memory import kv_values_per_token

    cases = [  # (description, layers, kv_heads, head_dim, bytes_per_value)
        ("the article's model in FP16: 80 layers, 8 KV heads, head dim 128, 2 bytes per value", 80, 8, 128, 2),
        ("the same model in FP8 (1 byte per value)", 80, 8, 128, 1),
        ("the same model in INT4 without scales (0.5 bytes per value)", 80, 8, 128, 0.5),
        ("the course model in fp32: 30 layers, 3 KV heads, head dim 64, 4 bytes per value", 30, 3, 64, 4),
        ("1 layer, 1 KV head, head dim 1, 2 bytes per value", 1, 1, 1, 2),
    ]
    for description, layers, kv_heads, head_dim, per_value in cases:
        want = kv_values_per_token(layers, kv_heads, head_dim) * per_value
        got, problem = call_learner(lambda: kv_bytes_per_token(layers, kv_heads, head_dim, per_value), description)
        if problem:
            return verdict("kv_bytes_per_token", problem)
        if isinstance(got, bool) or not isinstance(got, (int, float)) or not math.isclose(got, want):
            hint = " (count both K and V: each layer stores a key and a value per KV head)" \
                if isinstance(got, (int, float)) and math.isclose(2 * got, want) else ""
            return verdict("kv_bytes_per_token", f"for {description} it returned {got!r}, expected {want:g}{hint}")
    return verdict("kv_bytes_per_token", None)


def check_max_streams(max_streams) -> bool:
    """Check a learner's max_streams(gpu_mem_gb, weights_gb, gb_per_stream): whole streams whose KV
    fits beside the weights, and 0 (not a negative number) when the weights alone overflow the GPU."""
    from radarlab.kvcache.memory import kv_gb_per_stream, max_concurrent_streams

    fp16 = kv_gb_per_stream(80, 8, 128, 32768, "fp16")
    int4 = kv_gb_per_stream(80, 8, 128, 32768, "int4", 128)
    cases = [  # (description, gpu, weights, per stream)
        (f"48 GB, no weights, {fp16:.4f} GB per stream (the article's FP16 row)", 48.0, 0.0, fp16),
        (f"48 GB, 35 GB of 4-bit 70B weights, {int4:.4f} GB per stream (INT4 with scales)", 48.0, 35.0, int4),
        ("50 GB, 2 GB of weights, exactly 12 GB per stream", 50.0, 2.0, 12.0),
        ("48 GB, 140 GB of fp16 70B weights, 1 GB per stream", 48.0, 140.0, 1.0),
        ("80 GB, 80 GB of weights, 1 GB per stream", 80.0, 80.0, 1.0),
    ]
    for description, gpu, weights, per in cases:
        want = max_concurrent_streams(gpu, weights, per)
        got, problem = call_learner(lambda: max_streams(gpu, weights, per), description)
        if problem:
            return verdict("max_streams", problem)
        if got != want or isinstance(got, bool):
            if isinstance(got, (int, float)) and got < 0:
                hint = " (when the weights do not fit, no stream fits: return 0)"
            elif isinstance(got, float) and got != int(got):
                hint = " (a stream needs its whole context: round down to a whole number)"
            elif isinstance(got, (int, float)) and got > want:
                hint = " (round down: a part of a stream cannot be served)"
            else:
                hint = ""
            return verdict("max_streams", f"for {description} it returned {got!r}, expected {want}{hint}")
    return verdict("max_streams", None)


# --- notebook 02: the contiguous KV cache and its reservation waste ---------------------------------

def check_append_to_contiguous_cache(append_to_contiguous_cache) -> bool:
    """Check a learner's append_to_contiguous_cache(k_cache, v_cache, row, seq_len, k, v): the n new
    tokens go to positions seq_len-n .. seq_len-1 of the row, in place, nothing else changes, and the
    whole context's keys and values come back."""
    import torch

    from radarlab.kvcache.contiguous import append_to_row

    name = "append_to_contiguous_cache"
    gen = torch.Generator().manual_seed(0)

    def rand(*shape):
        return torch.randn(*shape, generator=gen)

    def numbered(n, heads, dim, first):  # token i's vectors are all first + i: easy to read in a message
        return torch.arange(first, first + n, dtype=torch.float32)[:, None, None].expand(n, heads, dim).clone()

    filled = rand(3, 8, 3, 4)  # 3 rows of 8 positions, 3 KV heads, head dim 4, already holding data
    cases = [  # (description, k_cache, v_cache, row, seq_len, k, v)
        ("a prefill of 3 tokens into row 0 of an empty cache of 2 rows x 6 positions (1 KV head, head dim 2)",
         torch.zeros(2, 6, 1, 2), torch.zeros(2, 6, 1, 2), 0, 3, numbered(3, 1, 2, 1), -numbered(3, 1, 2, 1)),
        ("one decode token into row 0, which held 3 tokens (seq_len=4 after the step)",
         torch.cat([numbered(3, 1, 2, 1), torch.zeros(3, 1, 2)])[None].repeat(2, 1, 1, 1), torch.zeros(2, 6, 1, 2),
         0, 4, numbered(1, 1, 2, 4), -numbered(1, 1, 2, 4)),
        ("a prefill of 2 tokens into row 1 while row 0 holds another sequence",
         torch.ones(2, 6, 1, 2), torch.ones(2, 6, 1, 2), 1, 2, numbered(2, 1, 2, 10), -numbered(2, 1, 2, 10)),
        ("2 new tokens filling the last positions of row 2 of a full cache (3 KV heads, head dim 4)",
         filled.clone(), -filled.clone(), 2, 8, rand(2, 3, 4), rand(2, 3, 4)),
    ]
    for description, k_cache, v_cache, row, seq_len, k, v in cases:
        start = seq_len - k.shape[0]
        want_k, want_v = k_cache.clone(), v_cache.clone()
        append_to_row(want_k, want_v, row, seq_len, k, v)
        got, problem = call_learner(
            lambda: append_to_contiguous_cache(k_cache, v_cache, row, seq_len, k.clone(), v.clone()), description)
        if problem:
            return verdict(name, problem)
        for label, cache, want in (("key", k_cache, want_k), ("value", v_cache, want_v)):
            if not torch.equal(cache, want):
                r, p = (int(i) for i in (cache != want).any(-1).any(-1).nonzero()[0])
                should = (f"the new token {p - start}'s {label}" if r == row and start <= p < seq_len
                          else "what it held before (it should not change)")
                return verdict(name, f"for {description}, the {label} cache at row {r}, position {p} holds the "
                                     f"wrong values; it should hold {should}. Write in place, at positions "
                                     f"seq_len - n .. seq_len - 1 = {start} .. {seq_len - 1}")
        if not isinstance(got, tuple) or len(got) != 2:
            return verdict(name, f"for {description} it returned {type(got).__name__}, expected a tuple (keys, values)")
        for label, g, w in (("keys", got[0], want_k[row, :seq_len]), ("values", got[1], want_v[row, :seq_len])):
            problem = _first_tensor_difference(g, w, atol=0.0, rtol=0.0)
            if problem:
                return verdict(name, f"for {description} the returned {label} were {problem} (return the row's "
                                     f"first seq_len positions: the whole context)")
    return verdict(name, None)


def check_reservation_utilisation(reservation_utilisation) -> bool:
    """Check a learner's reservation_utilisation(context_lens, max_model_len, block_size) -> (contiguous,
    paged): the fraction of reserved positions that hold tokens, for a snapshot of running requests."""
    import math

    from radarlab.bench.reservation import snapshot_utilisation

    name = "reservation_utilisation"

    want = snapshot_utilisation

    cases = [  # (description, context_lens, max_model_len, block_size)
        ("context_lens=[3, 5], max_model_len=8, block_size=4", [3, 5], 8, 4),
        ("context_lens=[16], max_model_len=64, block_size=16 (one exactly full block)", [16], 64, 16),
        ("context_lens=[17, 1, 100], max_model_len=2048, block_size=16", [17, 1, 100], 2048, 16),
        ("context_lens=[7, 9], max_model_len=16, block_size=1", [7, 9], 16, 1),
        ("context_lens=[2048], max_model_len=2048, block_size=128", [2048], 2048, 128),
    ]
    for description, lens, max_len, bs in cases:
        expected = want(lens, max_len, bs)
        got, problem = call_learner(lambda: reservation_utilisation(list(lens), max_len, bs), description)
        if problem:
            return verdict(name, problem)
        if (not isinstance(got, (tuple, list)) or len(got) != 2
                or not all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in got)):
            return verdict(name, f"for {description} it returned {got!r}, expected two numbers (contiguous, paged)")
        if not math.isclose(got[0], expected[0], rel_tol=1e-9):
            return verdict(name, f"for {description} the contiguous utilisation was {got[0]!r}, expected "
                                 f"{expected[0]!r} (each request reserves max_model_len positions)")
        if not math.isclose(got[1], expected[1], rel_tol=1e-9):
            floor = sum(lens) / max(1, sum(n // bs * bs for n in lens))
            hint = (" (a partly filled block is reserved whole: round each request's blocks up)"
                    if math.isclose(got[1], floor, rel_tol=1e-9) or got[1] > 1 else "")
            return verdict(name, f"for {description} the paged utilisation was {got[1]!r}, expected {expected[1]!r}{hint}")
    for description, lens, max_len in [("an empty list of requests", [], 8),
                                       ("context_lens=[9] with max_model_len=8 (longer than a row)", [9], 8),
                                       ("context_lens=[0] (a running request holds at least one token)", [0], 8)]:
        try:
            got = reservation_utilisation(list(lens), max_len, 4)
        except NotImplementedError:
            return verdict(name, "the function is not written yet (it raises NotImplementedError)")
        except ValueError:
            continue
        except Exception as err:
            return verdict(name, f"for {description} it raised {type(err).__name__}: {err}; expected ValueError")
        return verdict(name, f"for {description} it returned {got!r}; expected it to raise ValueError")
    return verdict(name, None)


# --- notebook 03: paged KV cache -------------------------------------------------------------------

def check_slot_mapping(slot_mapping) -> bool:
    """Check a learner's slot_mapping(block_table, block_size, start, n): the slots of positions
    start .. start+n-1 of a sequence whose logical block i lives in physical block block_table[i]."""
    from radarlab.kvcache.kv_cache_manager import KVCacheBlocks

    cases = [  # (description, block_table, block_size, start, n)
        ("block_table=[7], block_size=4, start=0, n=3 (one block)", [7], 4, 0, 3),
        ("block_table=[2, 5], block_size=4, start=0, n=6 (the 5th token starts block 5)", [2, 5], 4, 0, 6),
        ("block_table=[2, 5], block_size=4, start=5, n=1 (one decode step)", [2, 5], 4, 5, 1),
        ("block_table=[3, 0, 9], block_size=2, start=1, n=4 (blocks out of order)", [3, 0, 9], 2, 1, 4),
        ("block_table=[4, 1, 6], block_size=1, start=0, n=3 (block size 1: slot = block id)", [4, 1, 6], 1, 0, 3),
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
            return verdict("slot_mapping", f"for {description} it returned {got!r}; expected a list of ints {want}")
        if got_list != want:
            positions = list(range(start, start + n))
            if got_list == positions:
                hint = " (those are the positions; map each through its physical block, block_table[p // block_size])"
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
            return verdict(name, f"{where}, {what} raised {type(err).__name__}: {err}; expected it to {expected(want)}")
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

    from radarlab.kvcache.kv_cache_manager import KVCacheManager
    from radarlab.kvcache.block_pool import NoFreeBlocks
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
            table, num_slots, free = manager.get_block_table(seq), manager.num_slots(seq), alloc.num_free_blocks
            counts = [alloc.ref_count(b) for b in table]
            shared = num_slots % bs != 0 and counts[-1] > 1
            need = cdiv(num_slots + num_new, bs) - len(table) + int(shared)
            where = "" if n < fixed_count else "in a random run of allocate, fork, append and free: "
            state = (f"{where}a sequence with {num_slots} tokens in blocks {table} (block size {bs}, their ref counts "
                     f"{counts}), {blocks(free)} free, appending {num_new} token{'s' if num_new > 1 else ''}")
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
                    return verdict(name, f"for {state} it returned {got!r}; it needs {blocks(need)} with {free} free, "
                                         f"so it should raise NoFreeBlocks")
                changed = [f"{what} {now} (before: {was})" for what, now, was in (
                    ("ref counts", list(mine.ref_counts), before[0]),
                    ("free list", list(mine.free_block_ids), before[1]), ("block list", given, table)) if now != was]
                if changed:
                    return verdict(name, f"for {state} it raised NoFreeBlocks (right: it needs {blocks(need)}) but "
                                         f"changed things first: {'; '.join(changed)}. Count what you need before "
                                         f"taking any block")
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
                    hint = (f"block {table[-1]} is partly filled and shared (ref count {counts[-1]}): take a private "
                            f"copy before writing into it")
                elif got_copies and not want_copies:
                    hint = (f"the last block is full ({num_slots} is a multiple of {bs}): the new tokens go into "
                            f"new blocks, so nothing needs copying" if num_slots % bs == 0 else
                            f"block {table[-1]} is not shared (ref count {counts[-1]}): write into it, no copy")
                elif len(got_table) != len(want_table):
                    hint = (f"{num_slots} + {num_new} tokens need cdiv({num_slots + num_new}, {bs}) = "
                            f"{blocks(len(want_table))}")
                elif sorted(got_table) == sorted(want_table):
                    hint = "take the private copy first, then the new blocks"
                else:
                    hint = "allocate with allocator.allocate() or allocate_many(n), which take the free list in order"
                return verdict(name, f"for {state} it returned blocks {got_table} and copies {got_copies}; expected "
                                     f"{want_table} and {want_copies} ({hint})")
            if list(mine.ref_counts) != list(alloc.ref_counts):
                hint = " (after taking a private copy, let go of the shared block once: allocator.free)" \
                    if want_copies else ""
                return verdict(name, f"for {state} the ref counts became {mine.ref_counts}; expected "
                                     f"{alloc.ref_counts}{hint}")
            if list(mine.free_block_ids) != list(alloc.free_block_ids):
                return verdict(name, f"for {state} the free list became {list(mine.free_block_ids)}; expected "
                                     f"{list(alloc.free_block_ids)}")
    return verdict(name, None)


# --- notebook 04: paged attention kernels ----------------------------------------------------------

def check_reshape_and_cache(reshape_and_cache) -> bool:
    """Check a learner's reshape_and_cache(k, v, k_cache, v_cache, slot_mapping): token t's k[t] and v[t]
    ([num_kv_heads, head_dim]) written in place into the pools [num_blocks, block_size, num_kv_heads,
    head_dim] at slot_mapping[t] = block * block_size + row; a slot of -1 is padding and writes nothing.
    Every other slot must keep what it held, so the pools start filled with a marker value."""
    import torch

    from radarlab.attention.kv_write import reshape_and_cache as reference

    name = "reshape_and_cache"
    gen = torch.Generator().manual_seed(4)
    cases = [  # (description, num_blocks, block_size, kv_heads, head_dim, slots, cache dtype)
        ("3 tokens into slots [5, 6, 7] of 3 blocks of 4 (block 1, rows 1-3), 1 KV head, head_dim 2",
         3, 4, 1, 2, [5, 6, 7], torch.float32),
        ("4 tokens with slots [9, -1, 2, -1] (-1 is padding: nothing is written for it)",
         3, 4, 1, 2, [9, -1, 2, -1], torch.float32),
        ("block_size 1 (the slot is the block id), slots [3, 0, 2]", 4, 1, 2, 4, [3, 0, 2], torch.float32),
        ("6 tokens at slots out of order across blocks of 16, 2 KV heads, head_dim 8",
         4, 16, 2, 8, [37, 15, 16, 0, 63, 40], torch.float32),
        ("a bfloat16 pool with float32 k and v (store in the pool's dtype)", 2, 4, 2, 4, [1, 6], torch.bfloat16),
        ("no tokens at all (an empty slot_mapping)", 2, 4, 1, 2, [], torch.float32),
    ]
    marker = 7.0
    for description, num_blocks, bs, heads, dim, slots, dtype in cases:
        shape = (num_blocks, bs, heads, dim)
        k = torch.randn(len(slots), heads, dim, generator=gen)
        v = torch.randn(len(slots), heads, dim, generator=gen)
        slot_mapping = torch.tensor(slots, dtype=torch.long)
        want_k, want_v = torch.full(shape, marker, dtype=dtype), torch.full(shape, marker, dtype=dtype)
        reference(k, v, want_k, want_v, slot_mapping)
        got_k, got_v = torch.full(shape, marker, dtype=dtype), torch.full(shape, marker, dtype=dtype)
        try:
            reshape_and_cache(k.clone(), v.clone(), got_k, got_v, slot_mapping.clone())
        except NotImplementedError:
            return verdict(name, "the function is not written yet (it raises NotImplementedError)")
        except Exception as err:  # a learner's bug should read as a counterexample, not a traceback
            return verdict(name, f"for {description} it raised {type(err).__name__}: {err}")
        for pool, got, want in (("k_cache", got_k, want_k), ("v_cache", got_v, want_v)):
            if got.shape != want.shape or got.dtype != want.dtype:
                return verdict(name, f"for {description} {pool} became {tuple(got.shape)} {got.dtype}; write into "
                                     f"the pool in place, keeping its shape {shape} and dtype {dtype}")
            bad = (got != want).reshape(num_blocks, bs, -1).any(-1)
            if bad.any():
                block, row = (int(i) for i in bad.nonzero()[0])
                slot = block * bs + row
                if slot in slots:
                    what = f"token {slots.index(slot)}'s {'key' if pool == 'k_cache' else 'value'}"
                else:
                    what = f"the marker {marker:g} it held (no token maps to slot {slot})"
                hint = ""
                if slot == num_blocks * bs - 1 and -1 in slots and slot not in slots:
                    hint = " (slot -1 is padding: skip it, or torch indexing wraps it round to the last slot)"
                return verdict(name, f"for {description} {pool}[{block}, {row}] (slot {slot}) holds "
                                     f"{got[block, row].flatten()[:4].tolist()} instead of {what}{hint}")
    return verdict(name, None)


def _raised_not_written(err: BaseException) -> bool:
    """Whether an error comes from the stub's bare `raise NotImplementedError()`, also when Triton wraps
    it: the interpreter raises InterpreterError from it, and the compiler rejects the raise statement
    quoting its source. Triton's own NotImplementedErrors carry a message, so they do not count."""
    while err is not None:
        if isinstance(err, NotImplementedError) and not str(err) or "raise NotImplementedError()" in str(err):
            return True
        err = err.__cause__ or err.__context__
    return False


def check_store_kv_kernel(store_kv) -> bool:
    """Check a learner's store-KV Triton kernel through its launcher store_kv(k, v, k_cache, v_cache,
    slot_mapping), against radarlab.kvcache.paged_cache.reshape_and_cache, bit for bit.

    A kernel writes through raw pointers, so a wrong address lands outside the pool instead of raising.
    Each pool is therefore a view into a bigger buffer: one block of guard before it (where slot -1
    lands if padding is not skipped) and num_blocks * block_size blocks after it (where a slot used as
    a block id lands). Everything outside the pool must keep its marker value, and so must every slot
    no token maps to. Few tokens per case: under TRITON_INTERPRET=1 every program runs in Python."""
    import torch

    from radarlab.device import default_device
    from radarlab.attention.kv_write import reshape_and_cache as reference

    name = "store_kv_kernel"
    device = default_device()
    gen = torch.Generator().manual_seed(6)
    cases = [  # (description, num_blocks, block_size, kv_heads, head_dim, slots)
        ("3 tokens into slots [5, 6, 7] of a pool of 3 blocks of 4 (block 1, rows 1-3), 2 KV heads, head_dim 16",
         3, 4, 2, 16, [5, 6, 7]),
        ("4 tokens with slots [9, -1, 2, -1] in 3 blocks of 4 (-1 is padding: nothing is written for it)",
         3, 4, 2, 16, [9, -1, 2, -1]),
        ("block size 1 (the slot is the block id), slots [3, 0, 2], 3 KV heads (padded to 4 lanes), head_dim 16",
         4, 1, 3, 16, [3, 0, 2]),
        ("5 tokens at slots [37, 15, -1, 0, 63] of 4 blocks of 16, 3 KV heads, head_dim 32",
         4, 16, 3, 32, [37, 15, -1, 0, 63]),
        ("head_dim 24 (padded to 32 lanes), 2 KV heads, slots [6, 1, -1] of 2 blocks of 4", 2, 4, 2, 24, [6, 1, -1]),
    ]
    marker = 7.0
    for description, num_blocks, bs, heads, dim, slots in cases:
        k = torch.randn(len(slots), heads, dim, generator=gen)
        v = torch.randn(len(slots), heads, dim, generator=gen)
        slot_mapping = torch.tensor(slots, dtype=torch.long)
        shape = (num_blocks, bs, heads, dim)
        want = {"k_cache": torch.full(shape, marker), "v_cache": torch.full(shape, marker)}
        reference(k, v, want["k_cache"], want["v_cache"], slot_mapping)
        guard_after = num_blocks * bs
        buffers = {pool: torch.full((1 + num_blocks + guard_after, bs, heads, dim), marker, device=device)
                   for pool in want}
        got = {pool: buffer[1:1 + num_blocks] for pool, buffer in buffers.items()}
        try:
            store_kv(k.to(device), v.to(device), got["k_cache"], got["v_cache"], slot_mapping.to(device))
        except Exception as err:  # a learner's bug should read as a counterexample, not a traceback
            if _raised_not_written(err):
                return verdict(name, "the kernel is not written yet (it raises NotImplementedError)")
            while err.__cause__ is not None:  # the learner's error, not Triton's wrapper around it
                err = err.__cause__
            hint = (" (the interpreter cannot store under a mask that combines a block with a single value, such "
                    "as (d < head_dim) & (slot >= 0); skip padding with `if slot < 0: return` instead)"
                    if "mask has unsupported dtype" in str(err) else "")
            return verdict(name, f"for {description} it raised {type(err).__name__}: {err}{hint}")
        for pool, buffer in buffers.items():
            buffer = buffer.cpu()
            before, after = buffer[:1] != marker, buffer[1 + num_blocks:] != marker
            if before.any():
                hint = (f"slot -1 is padding: skip it, or its block -1 // {bs} and row -1 % {bs} point before the "
                        f"pool" if -1 in slots else "check the destination address")
                return verdict(name, f"for {description} it wrote {int(before.sum())} values into the memory just "
                                     f"before {pool} ({hint})")
            if after.any():
                hint = ("is the slot used as a block id? block = slot // block_size, row = slot % block_size"
                        if bs > 1 else "check the destination address")
                first = int(after.flatten(1).any(1).nonzero()[0])
                return verdict(name, f"for {description} it wrote past the end of {pool}, into block "
                                     f"{num_blocks + first} of a pool of {num_blocks} ({hint})")
        for pool in want:
            g, w = got[pool].cpu(), want[pool]
            bad = (g != w).any(-1)  # [num_blocks, block_size, kv_heads]
            if not bad.any():
                continue
            block, row, head = (int(i) for i in bad.nonzero()[0])
            slot = block * bs + row
            label = "key" if pool == "k_cache" else "value"
            if slot not in slots:
                what = f"the marker {marker:g} it held (no token maps to slot {slot})"
                hint = ""
            else:
                t = slots.index(slot)
                what = f"token {t}'s {label} for that head"
                other = (v if pool == "k_cache" else k)[t, head]
                if torch.equal(g[block, row, head], other):
                    swapped = "value" if label == "key" else "key"
                    hint = f" (it holds token {t}'s {swapped}: K goes to k_cache, V to v_cache)"
                elif (g[block, row, head] == marker).all():
                    hint = " (nothing was written there)" if head == 0 else \
                        " (nothing was written there: store every KV head, at h * the stride of a head)"
                else:
                    hint = ""
            return verdict(name, f"for {description}, {pool}[{block}, {row}, {head}] (slot {slot}, KV head {head}) "
                                 f"holds [{', '.join(f'{x:.3g}' for x in g[block, row, head][:3].tolist())}, ...] "
                                 f"instead of {what}{hint}")
    return verdict(name, None)


def _online_softmax_describe(got, shapes) -> str | None:
    """Why got is not an (m, l, acc) triple of tensors of the given shapes, or None if it is."""
    import torch

    if not isinstance(got, (tuple, list)) or len(got) != 3:
        return f"returned {type(got).__name__}, expected a tuple (m, l, acc)"
    for label, value, shape in zip(("m", "l", "acc"), got, shapes):
        if not isinstance(value, torch.Tensor):
            return f"returned a {type(value).__name__} for {label}, expected a tensor"
        if tuple(value.shape) != shape:
            return f"returned {label} of shape {tuple(value.shape)}, expected {shape}"
    return None


def check_online_softmax_update(online_softmax_update) -> bool:
    """Check a learner's online_softmax_update(m, l, acc, scores, values) -> (m, l, acc).

    The running state of one query head (rows: the G heads of a GQA group) after some blocks of keys:
    m [G] the largest score so far, l [G] the sum of exp(score - m), acc [G, D] the sum of
    exp(score - m) * value. scores [G, N] and values [N, D] are the next block. The checker folds the
    function over the blocks of each case, from the empty state (m = -inf, l = 0, acc = 0), and compares
    the result with the same quantities computed from all the scores at once; acc / l must then be
    softmax(scores) @ values, full attention. Scores of -inf are padding (positions past the end)."""
    import torch

    name = "online_softmax_update"
    gen = torch.Generator().manual_seed(11)

    def split(scores, values, sizes):
        cuts = torch.tensor([0, *sizes]).cumsum(0).tolist()
        return [(scores[:, a:b], values[a:b]) for a, b in zip(cuts[:-1], cuts[1:])]

    cases = []  # (description, scores [G, N], values [N, D], block sizes)
    cases.append(("one block of scores [[0, 0]] with values [[1], [3]]",
                  torch.tensor([[0.0, 0.0]]), torch.tensor([[1.0], [3.0]]), [2]))
    cases.append(("two blocks, scores [[0, 1]] then [[5, 2]] (the second holds a new maximum)",
                  torch.tensor([[0.0, 1.0, 5.0, 2.0]]), torch.tensor([[1.0], [2.0], [3.0], [4.0]]), [2, 2]))
    cases.append(("a block [[1, 3]] then a last block [[2, -inf, -inf]] whose tail is padding",
                  torch.tensor([[1.0, 3.0, 2.0, float("-inf"), float("-inf")]]),
                  torch.tensor([[1.0], [-1.0], [2.0], [0.0], [0.0]]), [2, 3]))
    cases.append(("large scores, [[100, 98]] then [[101, 0]] (exp(100) overflows float32: subtract the max)",
                  torch.tensor([[100.0, 98.0, 101.0, 0.0]]), torch.tensor([[1.0], [2.0], [3.0], [4.0]]), [2, 2]))
    scores = torch.randn(3, 37, generator=gen) * 4
    cases.append(("random scores of 3 heads over 37 keys (head_dim 8) in blocks of [5, 1, 16, 8, 7]",
                  scores, torch.randn(37, 8, generator=gen), [5, 1, 16, 8, 7]))
    scores = torch.randn(4, 9, generator=gen) * 4
    cases.append(("random scores of 4 heads over 9 keys (head_dim 16), one key per block",
                  scores, torch.randn(9, 16, generator=gen), [1] * 9))
    sizes = torch.randint(1, 12, (12,), generator=gen).tolist()
    scores = torch.randn(2, sum(sizes), generator=gen) * 4
    cases.append((f"random scores of 2 heads over {sum(sizes)} keys (head_dim 4) in random blocks {sizes}",
                  scores, torch.randn(sum(sizes), 4, generator=gen), sizes))

    for description, scores, values, sizes in cases:
        g, d = scores.shape[0], values.shape[1]
        m = torch.full((g,), float("-inf"))
        l = torch.zeros(g)
        acc = torch.zeros(g, d)
        for i, (s, v) in enumerate(split(scores, values, sizes)):
            try:
                out = online_softmax_update(m.clone(), l.clone(), acc.clone(), s.clone(), v.clone())
            except NotImplementedError:
                return verdict(name, "the function is not written yet (it raises NotImplementedError)")
            except Exception as err:  # a learner's bug should read as a counterexample, not a traceback
                return verdict(name, f"for {description}, block {i} raised {type(err).__name__}: {err}")
            wrong = _online_softmax_describe(out, [(g,), (g,), (g, d)])
            if wrong:
                return verdict(name, f"for {description}, block {i}: it {wrong}")
            m, l, acc = (x.detach().float() for x in out)

        want_m = scores.max(dim=1).values
        p = torch.exp(scores - want_m[:, None])
        want_l, want_acc = p.sum(dim=1), p @ values
        attention = torch.softmax(scores, dim=1) @ values
        if not (torch.isfinite(acc).all() and torch.isfinite(l).all()):
            hint = (" (exp of a score near 100 overflows float32: exponentiate score - m, never the raw score)"
                    if scores.max() > 80 else "")
            return verdict(name, f"for {description} l or acc holds inf or NaN{hint}")
        if not torch.allclose(m, want_m, rtol=1e-6, atol=1e-6):
            return verdict(name, f"for {description} m ended as {m.tolist()}, expected the largest score "
                                 f"{want_m.tolist()}")
        if not torch.allclose(l, want_l, rtol=1e-5, atol=1e-6) or not torch.allclose(acc, want_acc, rtol=1e-5,
                                                                                       atol=1e-5):
            out = acc / l[:, None]
            if torch.allclose(out, attention, rtol=1e-4, atol=1e-5):
                return verdict(name, f"for {description} acc / l is right but l ended as {l.tolist()} (expected "
                                     f"{want_l.tolist()}): keep l = sum of exp(score - m) and acc unnormalised, "
                                     f"and divide once at the end")
            hint = (" (when the maximum grows, scale the old l and acc by exp(m_old - m_new))"
                    if len(sizes) > 1 else "")
            return verdict(name, f"for {description} acc / l is {out.flatten()[:4].tolist()}, but full softmax "
                                 f"attention gives {attention.flatten()[:4].tolist()}{hint}")
    return verdict(name, None)


# --- notebook 05: continuous batching ----------------------------------------------------------------

def _put_running(scheduler, request_id, num_prompt_tokens: int, num_computed: int, decoding: bool):
    """A request placed straight into the scheduler's running list, as if earlier steps had computed
    its first num_computed tokens (and reserved their slots); a decoding one also holds the token it
    sampled last, not computed yet. How the checkers' references set up a state to schedule from."""
    from radarlab.engine import Request, RequestStatus, SamplingParams

    request = Request(request_id, [1] * num_prompt_tokens, SamplingParams())
    scheduler.manager.allocate(request, num_computed)
    request.num_computed_tokens = num_computed
    if decoding:
        request.append_token_ids([1])
    request.status = RequestStatus.RUNNING
    scheduler.running.append(request)
    return request


def _schedule_token_budget_reference(running, waiting, budget, max_num_seqs):
    """The answer of radarlab's own Scheduler (vLLM v1's rule) on a pool roomy enough that blocks
    never bind: running requests with `remaining` prompt tokens still to prefill (0: decoding), then
    waiting prompts of the given lengths, head first."""
    from radarlab.engine import Request, SamplingParams, Scheduler
    from radarlab.kvcache.kv_cache_manager import KVCacheManager

    manager = KVCacheManager(num_blocks=1024, block_size=16, enable_prefix_caching=False)
    scheduler = Scheduler(manager, max_num_seqs=max_num_seqs, max_num_batched_tokens=budget)
    done_prefill = 8  # tokens each running request has computed already
    requests = [_put_running(scheduler, ("running", i), done_prefill + remaining, done_prefill, remaining == 0)
                for i, remaining in enumerate(running)]
    for i, prompt_len in enumerate(waiting):
        request = Request(("waiting", i), [1] * prompt_len, SamplingParams())
        scheduler.add_request(request)
        requests.append(request)
    out = scheduler.schedule()
    scheduled = dict(zip((r.request_id for r in out.requests), out.num_scheduled_tokens))
    tokens = [scheduled.get(r.request_id, 0) for r in requests]
    return tokens[:len(running)], tokens[len(running):]


def check_schedule_token_budget(schedule_token_budget) -> bool:
    """Check a learner's schedule_token_budget(running, waiting, budget, max_num_seqs) -> (running_tokens,
    waiting_tokens). running: prompt tokens each running request still has to prefill (0 = decoding);
    waiting: prompt lengths of the queue, head first. Each case names the rule it tests."""
    import random

    name = "schedule_token_budget"
    rng = random.Random(5)
    big_running = [0] * 5 + [70]
    big_waiting = [rng.randint(1, 40) for _ in range(6)]
    cases = [  # (description, running, waiting, budget, max_num_seqs, the rule it tests)
        ("running=[0, 0, 0] (three decodes), waiting=[5], budget=16, max_num_seqs=8", [0, 0, 0], [5], 16, 8,
         "each decode takes 1 token; the 5-token prompt fits in what is left"),
        ("running=[0, 0, 50] (two decodes, then a prompt with 50 tokens left), waiting=[], budget=16, max_num_seqs=8",
         [0, 0, 50], [], 16, 8, "a running prefill takes a chunk of what is left of the budget: 16 - 2 = 14"),
        ("running=[0, 0], waiting=[40, 3], budget=16, max_num_seqs=8", [0, 0], [40, 3], 16, 8,
         "the head of the queue is admitted with a chunk of the 14 tokens left (chunked prefill); the 3-token "
         "prompt behind it then finds no budget: nobody overtakes the head"),
        ("running=[0, 0, 0], waiting=[2, 2, 2], budget=100, max_num_seqs=4", [0, 0, 0], [2, 2, 2], 100, 4,
         "max_num_seqs counts the running requests too: 3 run, so one seat is left"),
        ("running=[], waiting=[10, 20, 5], budget=32, max_num_seqs=2", [], [10, 20, 5], 32, 2,
         "two seats: the third request waits although 2 tokens of budget are left"),
        ("running=[0, 30], waiting=[4], budget=16, max_num_seqs=8", [0, 30], [4], 16, 8,
         "running requests are served first, in order; the prefill uses up the budget and the queue gets nothing"),
        ("running=[], waiting=[], budget=8, max_num_seqs=4 (an idle engine)", [], [], 8, 4,
         "nothing to schedule: two empty lists"),
        (f"running={big_running}, waiting={big_waiting}, budget=64, max_num_seqs=10", big_running, big_waiting, 64,
         10, "the same rules on a larger step"),
    ]
    for description, running, waiting, budget, seats, rule in cases:
        want = _schedule_token_budget_reference(running, waiting, budget, seats)
        got, problem = call_learner(lambda: schedule_token_budget(list(running), list(waiting), budget, seats),
                                    description)
        if problem:
            return verdict(name, problem)
        try:
            got_lists = ([int(n) for n in got[0]], [int(n) for n in got[1]])
            if len(got) != 2:
                raise ValueError
        except (TypeError, ValueError, IndexError, KeyError):
            return verdict(name, f"for {description} it returned {got!r}; expected two lists of ints "
                                 f"(running_tokens, waiting_tokens), here {want}")
        if got_lists != want:
            if sum(got_lists[0]) < sum(want[0]) and sum(got_lists[1]) > sum(want[1]):
                rule = "running requests are served first, then the queue gets what is left"
            return verdict(name, f"for {description} it returned {got_lists}, expected {want} ({rule})")
    return verdict(name, None)


def _preemption_reference(running, free_blocks, block_size=4):
    """Which running requests radarlab's Scheduler preempts this step, in order, set up in that state:
    running[i] = (blocks_held, needs_new_block) in arrival order, every request decoding, free_blocks
    free in the pool."""
    from radarlab.engine import Scheduler
    from radarlab.kvcache.kv_cache_manager import KVCacheManager

    manager = KVCacheManager(sum(held for held, _ in running) + free_blocks, block_size, enable_prefix_caching=False)
    scheduler = Scheduler(manager, max_num_seqs=max(1, len(running)), max_num_batched_tokens=4096,
                          max_model_len=4096)
    for i, (held, needs_new) in enumerate(running):
        # a full last block means the next token needs a new one; one slot left means it does not
        computed = held * block_size - (0 if needs_new else 1)
        _put_running(scheduler, i, computed, computed, decoding=True)
    return [r.request_id for r in scheduler.schedule().preempted]


def check_preemption_rule(preempt) -> bool:
    """Check a learner's preempt(running, free_blocks) -> preempted indices, in the order preempted.
    running[i] = (blocks_held, needs_new_block), oldest first; each request needing a block takes one,
    and when none is free the newest running request is preempted (its blocks freed) until it fits,
    or until the request itself was the newest. The reference is radarlab's Scheduler in that state."""
    import random

    name = "preempt"
    rng = random.Random(9)
    cases = [  # (description, running, free_blocks)
        ("running=[(2, True), (2, True)], free_blocks=1 (both need a block, one is free)",
         [(2, True), (2, True)], 1),
        ("running=[(1, True), (3, False), (1, True)], free_blocks=0",
         [(1, True), (3, False), (1, True)], 0),
        ("running=[(1, False), (1, False)], free_blocks=0 (nobody needs a block)", [(1, False), (1, False)], 0),
        ("running=[(3, True)], free_blocks=0 (alone and out of blocks: it preempts itself)", [(3, True)], 0),
        ("running=[(1, True), (1, True), (1, True), (1, True)], free_blocks=0 (each victim frees one block)",
         [(1, True)] * 4, 0),
        ("running=[(1, True), (2, False), (1, True)], free_blocks=0 (a victim that needed nothing still frees "
         "its blocks)", [(1, True), (2, False), (1, True)], 0),
        ("running=[(1, True), (1, True), (3, False)], free_blocks=0 (the victim frees 3 blocks: enough for "
         "both)", [(1, True), (1, True), (3, False)], 0),
        ("running=[], free_blocks=3 (nothing runs)", [], 3),
    ]
    for k in range(6):
        running = [(rng.randint(1, 4), rng.random() < 0.6) for _ in range(rng.randint(2, 8))]
        free = rng.randint(0, 2)
        cases.append((f"random case {k + 1}: running={running}, free_blocks={free}", running, free))
    for description, running, free in cases:
        want = _preemption_reference(running, free)
        got, problem = call_learner(lambda: preempt(list(running), free), description)
        if problem:
            return verdict(name, problem)
        try:
            got_list = [int(i) for i in got]
        except TypeError:
            return verdict(name, f"for {description} it returned {got!r}; expected a list of indices {want}")
        if got_list != want:
            if sorted(got_list) == sorted(want):
                hint = " (the same requests, in another order: preempt the newest first)"
            elif want and got_list and got_list[0] == 0 != want[0]:
                hint = " (preempt the newest running request, the last in the list, not the oldest)"
            else:
                hint = (" (each preempted request frees all the blocks it holds, and serving continues in "
                        "arrival order)")
            return verdict(name, f"for {description} it returned {got_list}, expected {want}{hint}")
    return verdict(name, None)


def check_latency_metrics(latency_metrics) -> bool:
    """Check a learner's latency_metrics(arrival, token_times) -> [(ttft, mean_itl), ...] against
    radarlab.lab.timeline.latency_metrics: TTFT from each request's own arrival, the mean gap
    between its tokens, and None as the ITL of a one-token output."""
    import math
    import random

    from radarlab.lab.timeline import latency_metrics as reference

    name = "latency_metrics"
    rng = random.Random(3)
    arrivals = sorted(round(rng.uniform(0, 5), 3) for _ in range(5))
    times = []
    for a, n in zip(arrivals, [1, 4, 2, 7, 3]):
        t, ts = a + rng.uniform(0.1, 2), []
        for _ in range(n):
            ts.append(round(t, 3))
            t += rng.uniform(0.02, 0.3)
        times.append(ts)
    cases = [  # (description, arrival, token_times)
        ("arrival=[0.0], token_times=[[0.5, 0.7, 0.9]]", [0.0], [[0.5, 0.7, 0.9]]),
        ("arrival=[0.0, 1.0], token_times=[[0.3, 0.4], [1.6, 1.7, 2.0]]", [0.0, 1.0], [[0.3, 0.4], [1.6, 1.7, 2.0]]),
        ("uneven gaps: arrival=[0.0], token_times=[[1.0, 1.1, 1.2, 2.0]]", [0.0], [[1.0, 1.1, 1.2, 2.0]]),
        ("a one-token output: arrival=[0.0, 0.0], token_times=[[0.4], [0.2, 0.5]]", [0.0, 0.0], [[0.4], [0.2, 0.5]]),
        (f"five requests, arrival={arrivals}, token_times={times}", arrivals, times),
    ]

    def close(a, b):
        return math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-12)

    for description, arrival, token_times in cases:
        want = reference(arrival, token_times)
        got, problem = call_learner(lambda: latency_metrics(list(arrival), [list(t) for t in token_times]),
                                    description)
        if problem:
            return verdict(name, problem)
        try:
            pairs = [(float(ttft), None if itl is None else float(itl)) for ttft, itl in got]
        except (TypeError, ValueError):
            return verdict(name, f"for {description} it returned {got!r}; expected a list of (ttft, mean_itl) "
                                 f"pairs, one per request")
        if len(pairs) != len(want):
            return verdict(name, f"for {description} it returned {len(pairs)} pairs for {len(want)} requests")
        for i, ((ttft, itl), (w_ttft, w_itl), t0, ts) in enumerate(zip(pairs, want, arrival, token_times)):
            if not close(ttft, w_ttft):
                hint = (" (TTFT counts from the request's own arrival, not from time 0)"
                        if close(ttft, ts[0]) else " (TTFT = the first token's time - arrival)")
                return verdict(name, f"for {description}, request {i}'s TTFT was {ttft:.6g}, "
                                     f"expected {w_ttft:.6g}{hint}")
            if w_itl is None:
                if itl is not None:
                    return verdict(name, f"for {description}, request {i} has one token and its ITL was {itl:.6g}; "
                                         f"expected None (there is no gap between tokens, and a 0 would pull "
                                         f"the average ITL down)")
                continue
            if itl is None or not close(itl, w_itl):
                if itl is not None and close(itl, (ts[-1] - t0) / len(ts)):
                    hint = " (the wait for the first token is TTFT, not a gap between tokens)"
                elif itl is not None and close(itl, (ts[-1] - ts[0]) / len(ts)):
                    hint = f" ({len(ts)} tokens have {len(ts) - 1} gaps between them)"
                else:
                    hint = " (the mean of the gaps between consecutive tokens)"
                got_itl = "None" if itl is None else f"{itl:.6g}"
                return verdict(name, f"for {description}, request {i}'s mean ITL was {got_itl}, "
                                     f"expected {w_itl:.6g}{hint}")
    return verdict(name, None)


# === notebook 06: FP8 KV cache ======================================================================

def _e4m3_bits(code: int) -> str:
    return f"{code >> 7} {code >> 3 & 15:04b} {code & 7:03b}"


def check_decode_e4m3(decode_e4m3) -> bool:
    """Check a learner's decode_e4m3(code) -> float against radarlab.quant.fp8.decode_code on all 256
    codes of E4M3fn, starting with the ones a learner can work by hand."""
    import math

    from radarlab.quant.fp8 import decode_code

    name = "decode_e4m3"
    first = [0x38, 0x40, 0xB8, 0x3C, 0x08, 0x01, 0x07, 0x00, 0x7E, 0x78, 0x7F, 0xFF]
    for code in first + [c for c in range(256) if c not in first]:
        want = decode_code(code, "e4m3")
        described = f"code 0x{code:02X} (bits {_e4m3_bits(code)})"
        got, problem = call_learner(lambda: decode_e4m3(code), described)
        if problem:
            return verdict(name, problem)
        if isinstance(got, bool) or not isinstance(got, (int, float)):
            return verdict(name, f"for {described} it returned {got!r}; expected a float")
        got = float(got)
        if math.isnan(want) and math.isnan(got) or got == want:
            continue
        sign, exp, man = -1.0 if code >> 7 else 1.0, code >> 3 & 15, code & 7
        if math.isnan(want):
            hint = " (S.1111.111 is E4M3fn's only NaN: there is no infinity)"
        elif exp == 15 and (math.isinf(got) or math.isnan(got)):
            hint = (" (E4M3fn, 'fn' for finite, has no infinity: exponent 15 holds normal numbers up to 448; only "
                    "mantissa 111 there is NaN)")
        elif exp == 0 and got == sign * (1 + man / 8) * 2.0 ** -7:
            hint = " (exponent 0 is subnormal: no implicit leading 1, value = (m/8) x 2^(1 - 7))"
        elif exp == 0 and got == sign * man / 8 * 2.0 ** -7:
            hint = " (subnormals use the exponent 1 - bias = -6, the same as exponent field 1)"
        elif got == -want:
            hint = " (bit 7 is the sign)"
        elif want and got in (2 * want, want / 2):
            hint = " (the exponent bias of E4M3 is 7)"
        else:
            hint = " (value = (-1)^s x (1 + m/8) x 2^(e - 7) for e > 0)"
        return verdict(name, f"{described} decoded to {got!r}, expected {want!r}{hint}")
    return verdict(name, None)


def check_encode_e4m3(encode_e4m3) -> bool:
    """Check a learner's encode_e4m3(x, rounding) -> uint8 codes against radarlab.quant.fp8.encode:
    round to nearest even ("rne") or toward zero ("rtz"), saturation at +-448, NaN kept as NaN."""
    import math

    import torch

    from radarlab.quant.fp8 import decode, encode

    name = "encode_e4m3"
    nan, inf = float("nan"), float("inf")
    sets = [
        ("exact codes", [1.0, 2.0, -0.5, 448.0, 2.0**-9, 0.0]),
        ("values between codes", [1.1, 1.05, -1.1, 300.0, -0.3, 0.01]),
        ("ties, exactly half-way between two codes", [1.0625, 1.1875, -1.0625, 3 * 2.0**-10, 2.0**-10, 432.0]),
        ("values beyond the range", [449.0, 500.0, 1e6, inf, -1e6, -inf]),
        ("NaN", [nan, 1.0]),
        ("values too small for any code but zero", [2.0**-11, 1e-6, -1e-6]),
    ]
    gen = torch.Generator().manual_seed(6)
    randoms = ("random K-like values, shape (4, 3, 64)", torch.randn(4, 3, 64, generator=gen) * 40)
    for rounding in ("rne", "rtz"):
        for description, values in [(d, torch.tensor(v)) for d, v in sets] + [randoms]:
            described = f"{description}, rounding={rounding!r}"
            want = encode(values, "e4m3", rounding)
            got, problem = call_learner(lambda: encode_e4m3(values.clone(), rounding), f"{described}: x={values}")
            if problem:
                return verdict(name, problem)
            if not isinstance(got, torch.Tensor) or got.dtype != torch.uint8 or got.shape != values.shape:
                kind = f"a {got.dtype} tensor of shape {tuple(got.shape)}" if isinstance(got, torch.Tensor) \
                    else repr(got)
                return verdict(name, f"for {described} it returned {kind}; expected uint8 codes of shape "
                                     f"{tuple(values.shape)}")
            both_nan = torch.isnan(decode(got)) & torch.isnan(decode(want))
            bad = (got != want) & ~both_nan
            if not bad.any():
                continue
            i = tuple(int(j) for j in bad.nonzero()[0])
            x, g, w = float(values[i]), int(got[i]), int(want[i])
            gv, wv = float(decode(got[i].reshape(1))), float(decode(want[i].reshape(1)))
            other = "rtz" if rounding == "rne" else "rne"
            if math.isnan(x):
                hint = " (a NaN stays NaN, code 0x7F, so a broken activation stays visible)"
            elif abs(x) > 448 and math.isnan(gv):
                hint = " (beyond 448 saturate to +-448, codes 0x7E / 0xFE: 0x7F is NaN)"
            elif abs(x) > 448:
                hint = " (beyond 448 saturate to +-448, codes 0x7E / 0xFE)"
            elif rounding == "rtz" and x < 0 and gv < x:
                hint = " (toward zero for negatives too: down in magnitude, not down the number line)"
            elif g == int(encode(values[i].reshape(1), "e4m3", other)):
                hint = (" (that is rounding toward zero, what vLLM's CPU kernels do; rne picks the nearer code)"
                        if rounding == "rne" else " (that is rounding to nearest; rtz keeps the code nearer zero)")
            elif rounding == "rne" and abs(abs(x) - abs(gv)) == abs(abs(x) - abs(wv)):
                hint = " (a tie goes to the even code, the one whose mantissa ends in 0)"
            else:
                hint = ""
            return verdict(name, f"for {described}, x={x!r} gave code 0x{g:02X} ({gv!r}), expected 0x{w:02X} "
                                 f"({wv!r}){hint}")
    return verdict(name, None)


def check_per_token_head_scale(per_token_head_scale) -> bool:
    """Check a learner's per_token_head_scale(x) -> [T, H] against radarlab.quant.fp8.dynamic_scale
    for E4M3: each head vector's amax over head_dim divided by 448, and 1 for an all-zero vector."""
    import torch

    from radarlab.quant.fp8 import dynamic_scale, max_finite

    name = "per_token_head_scale"
    gen = torch.Generator().manual_seed(60)
    zeros = torch.randn(3, 2, 8, generator=gen)
    zeros[1, 0] = 0.0
    cases = [
        ("one token, one head, x=[[[1, -2, 0.5]]]", torch.tensor([[[1.0, -2.0, 0.5]]])),
        ("two tokens, two heads, x[t, h] = [t + h + 1, -(t + h + 1) / 2]",
         torch.tensor([[[1.0, -0.5], [2.0, -1.0]], [[2.0, -1.0], [3.0, -1.5]]])),
        ("x of shape (3, 2, 8) where token 1, head 0 is all zeros", zeros),
        ("random K-like x of shape (5, 3, 64), amax in the hundreds", torch.randn(5, 3, 64, generator=gen) * 60),
    ]
    top = max_finite("e4m3")
    for description, x in cases:
        want = dynamic_scale(x, "e4m3")
        got, problem = call_learner(lambda: per_token_head_scale(x.clone()), description)
        if problem:
            return verdict(name, problem)
        if not isinstance(got, torch.Tensor) or tuple(got.shape) != tuple(want.shape):
            shape = tuple(got.shape) if isinstance(got, torch.Tensor) else type(got).__name__
            hint = " (one scale per token and head: the amax over head_dim, the last axis, only)"
            return verdict(name, f"for {description} it returned shape {shape}, expected {tuple(want.shape)}{hint}")
        g = got.detach().float()
        if torch.allclose(g, want, rtol=1e-5, atol=0):
            continue
        i = tuple(int(j) for j in (~torch.isclose(g, want, rtol=1e-5, atol=0)).nonzero()[0])
        amax = float(x[i].abs().max())
        if amax == 0:
            hint = " (an all-zero vector gets scale 1: a scale of 0 would make x / scale NaN)"
        elif abs(float(g[i]) - amax) <= 1e-6 * amax:
            hint = f" (divide the amax by the largest E4M3 value, {top:g}, so it lands on the top code)"
        else:
            hint = f" (scale = max |x| over head_dim / {top:g})"
        return verdict(name, f"for {description}, the scale of token {i[0]}, head {i[1]} was {float(g[i]):.6g}, "
                             f"expected {float(want[i]):.6g}{hint}")
    return verdict(name, None)


# === notebook 07: INT4 KV cache ========================================================================
# pack_nibbles, quantize_group (asymmetric, group-wise) and int4_bytes_per_token.

def check_pack_nibbles(pack_nibbles) -> bool:
    """Check a learner's pack_nibbles(codes) against radarlab.quant.int4.pack: uint8 codes 0..15 with an
    even last axis become bytes, code 2i in the low nibble and code 2i + 1 in the high one."""
    import torch

    from radarlab.quant.int4 import pack

    name = "pack_nibbles"
    gen = torch.Generator().manual_seed(7)
    cases = [  # (description, codes)
        ("codes [1, 2] (one byte: 2 in the high nibble, 1 in the low one)", torch.tensor([1, 2], dtype=torch.uint8)),
        ("codes [15, 0]", torch.tensor([15, 0], dtype=torch.uint8)),
        ("codes [0, 15, 8, 8]", torch.tensor([0, 15, 8, 8], dtype=torch.uint8)),
        ("random codes of shape (3, 8, 64) (pack along the last axis only)",
         torch.randint(0, 16, (3, 8, 64), generator=gen, dtype=torch.uint8)),
    ]
    for description, codes in cases:
        want = pack(codes)
        got, problem = call_learner(lambda: pack_nibbles(codes.clone()), description)
        if problem:
            return verdict(name, problem)
        swapped = codes[..., 1::2] | (codes[..., 0::2] << 4)
        if isinstance(got, torch.Tensor) and got.shape == want.shape and torch.equal(got, swapped) \
                and not torch.equal(swapped, want):
            return verdict(name, f"for {description} it returned {got.flatten()[:4].tolist()}, expected "
                                 f"{want.flatten()[:4].tolist()} (code 2i goes in the low nibble, 2i + 1 in the high one)")
        difference = _first_tensor_difference(got, want, atol=0, rtol=0)
        if difference:
            hint = " (the result is uint8, one byte per pair of codes)" if "dtype" in difference or "shape" in difference else ""
            return verdict(name, f"for {description} it returned {difference}{hint}")
    return verdict(name, None)


def reference_quantize_group(x, group_size: int):
    """radarlab's asymmetric INT4 group quantization (radarlab.quant.int4), in the exercise's form:
    (codes uint8 [..., n] unpacked, scales [..., n / g], zeros [..., n / g]) in float32. The scales and
    zeros are the ones the cache stores (fp16), so they differ from exact float32 ones by fp16 rounding."""
    from radarlab.quant.int4 import quantize, unpack

    packed, scales, zeros = quantize(x, group_size, symmetric=False)
    return unpack(packed), scales.float(), zeros.float()


def check_quantize_group(quantize_group) -> bool:
    """Check a learner's quantize_group(x, group_size) -> (codes, scales, zeros): asymmetric INT4 over
    groups of group_size consecutive values along the last axis, zero = the group's minimum, scale =
    (max - min) / 15, codes = round((x - zero) / scale) in 0..15. Accepted when the codes are uint8 in
    0..15, the scales and zeros match those rules (to fp16 precision), and every value comes back
    within half a step: |codes x scale + zero - x| <= scale / 2."""
    import torch

    name = "quantize_group"
    gen = torch.Generator().manual_seed(11)
    outlier = torch.randn(4, 64, generator=gen)
    outlier[:, 7] *= 20  # one large channel, as keys have
    cases = [  # (description, x, group_size)
        ("x = [0, 1, ..., 15], one group of 16 (scale 1, zero 0, codes 0..15)", torch.arange(16.0), 16),
        ("x = [-1, 1, 2, 5], groups of 2", torch.tensor([-1.0, 1.0, 2.0, 5.0]), 2),
        ("a group whose values are all equal: x = [3, 3, 3, 3, -2, 0, 1, 2], groups of 4 (no division by zero: "
         "every 3 must come back as 3)", torch.tensor([3.0, 3.0, 3.0, 3.0, -2.0, 0.0, 1.0, 2.0]), 4),
        ("random x of shape (2, 3, 64), groups of 32", torch.randn(2, 3, 64, generator=gen), 32),
        ("x of shape (4, 64) with one channel 20x larger, groups of 16", outlier, 16),
    ]
    for description, x, g in cases:
        got, problem = call_learner(lambda: quantize_group(x.clone(), g), description)
        if problem:
            return verdict(name, problem)
        if not isinstance(got, (tuple, list)) or len(got) != 3:
            return verdict(name, f"for {description} it returned {type(got).__name__}; expected (codes, scales, zeros)")
        codes, scales, zeros = got
        groups = x.reshape(*x.shape[:-1], x.shape[-1] // g, g)
        lo, hi = groups.amin(-1), groups.amax(-1)
        for label, t, shape in (("codes", codes, x.shape), ("scales", scales, lo.shape), ("zeros", zeros, lo.shape)):
            if not isinstance(t, torch.Tensor):
                return verdict(name, f"for {description}, {label} is a {type(t).__name__}, not a tensor")
            if tuple(t.shape) != tuple(shape):
                return verdict(name, f"for {description}, {label} has shape {tuple(t.shape)}, expected {tuple(shape)}"
                                     + (" (one per group)" if label != "codes" else " (one code per value, unpacked)"))
        if codes.dtype != torch.uint8:
            return verdict(name, f"for {description}, codes have dtype {codes.dtype}, expected torch.uint8")
        if int(codes.max()) > 15:
            return verdict(name, f"for {description}, a code is {int(codes.max())}: 4 bits hold 0..15 (clamp)")
        s, z = scales.float(), zeros.float()
        if not bool(torch.isfinite(s).all() & torch.isfinite(z).all()) or bool((s < 0).any()):
            return verdict(name, f"for {description}, the scales {s.flatten()[:4].tolist()} or zeros "
                                 f"{z.flatten()[:4].tolist()} are not finite and >= 0")
        if not torch.allclose(z, lo, rtol=2e-3, atol=1e-6):
            i = int((~torch.isclose(z, lo, rtol=2e-3, atol=1e-6)).flatten().nonzero()[0])
            return verdict(name, f"for {description}, group {i}'s zero point is {z.flatten()[i].item():.6g}, expected its "
                                 f"minimum {lo.flatten()[i].item():.6g} (asymmetric: code 0 stands for the minimum)")
        spread = hi > lo
        want_s = (hi - lo) / 15
        if not torch.allclose(s[spread], want_s[spread], rtol=2e-3, atol=0):
            i = int((spread & ~torch.isclose(s, want_s, rtol=2e-3, atol=0)).flatten().nonzero()[0])
            ratio = (s.flatten()[i] / want_s.flatten()[i]).item()
            hint = " (16 levels have 15 steps between them)" if abs(ratio - 15 / 16) < 1e-3 else \
                " (scale = (max - min) / 15)"
            return verdict(name, f"for {description}, group {i}'s scale is {s.flatten()[i].item():.6g}, expected "
                                 f"{want_s.flatten()[i].item():.6g}{hint}")
        back = (codes.float().reshape(groups.shape) * s[..., None] + z[..., None]).reshape(x.shape)
        err = (back - x).abs().reshape(groups.shape)
        allowed = s[..., None] / 2 * (1 + 1e-4) + 1e-6
        if bool((err > allowed).any()):
            idx = tuple(int(i) for i in (err > allowed).nonzero()[0])
            flat = tuple(idx[:-2]) + (idx[-2] * g + idx[-1],)
            return verdict(name, f"for {description}, x{list(flat)} = {x[flat].item():.6g} comes back as "
                                 f"{back[flat].item():.6g} (code {int(codes[flat])}), more than half a step "
                                 f"({s[idx[:-1]].item():.4g} / 2) away: round((x - zero) / scale), then clamp to 0..15")
    return verdict(name, None)


def reference_int4_bytes_per_token(layers, kv_heads, head_dim, group_size, symmetric, scale_bytes) -> int:
    """The exercise's answer from the calculator (radarlab.kvcache.memory, reading the table of formats)."""
    from radarlab.kvcache.memory import kv_bytes_per_token
    from radarlab.quant.formats import SCALE_BYTES

    scale_dtype = {b: name for name, b in SCALE_BYTES.items()}.get(scale_bytes)
    if scale_dtype is None:
        raise ValueError(f"scale_bytes must be one of {sorted(SCALE_BYTES.values())} (fp8 or fp16), got {scale_bytes!r}")
    name = f"int4_g{group_size}_{'sym' if symmetric else 'asym'}" + ("_fp8scales" if scale_dtype == "fp8" else "")
    return kv_bytes_per_token(layers, kv_heads, head_dim, name)


def check_int4_bytes_per_token(int4_bytes_per_token) -> bool:
    """Check a learner's int4_bytes_per_token(layers, kv_heads, head_dim, group_size, symmetric,
    scale_bytes) against the calculator (radarlab.kvcache.memory, reading radarlab.quant.formats): K and
    V of every layer and KV head, half a byte per value, plus per group a scale and, asymmetric, a zero
    point of scale_bytes bytes each."""
    import math

    from radarlab.kvcache.memory import kv_values_per_token

    name = "int4_bytes_per_token"
    cases = [  # (description, layers, kv_heads, head_dim, group, symmetric, scale_bytes)
        ("the article's model (80 layers, 8 KV heads, head dim 128), group 128, asymmetric, fp16 scales and zeros",
         80, 8, 128, 128, False, 2),
        ("the article's model, group 128, symmetric, fp16 scales", 80, 8, 128, 128, True, 2),
        ("the course model (30 layers, 3 KV heads, head dim 64), group 64, asymmetric, fp16", 30, 3, 64, 64, False, 2),
        ("the course model, group 32, asymmetric, fp8 scales and zeros (1 byte each)", 30, 3, 64, 32, False, 1),
        ("the course model, group 16, symmetric, fp16", 30, 3, 64, 16, True, 2),
    ]
    for description, layers, heads, d, g, sym, sb in cases:
        want = reference_int4_bytes_per_token(layers, heads, d, g, sym, sb)
        got, problem = call_learner(lambda: int4_bytes_per_token(layers, heads, d, g, sym, sb), description)
        if problem:
            return verdict(name, problem)
        if isinstance(got, bool) or not isinstance(got, (int, float)) or not math.isclose(got, want):
            values = kv_values_per_token(layers, heads, d)
            groups = values // g
            hints = {values / 2: " (that is the 4-bit codes alone: add the scales and zero points of every group)",
                     want / 2: " (count both K and V)",
                     values / 2 + groups * sb: " (an asymmetric group stores a zero point beside its scale)",
                     values / 2 + 2 * groups * sb: " (a symmetric group stores only a scale, no zero point)"}
            hint = next((h for v, h in hints.items() if isinstance(got, (int, float)) and math.isclose(got, v)), "")
            return verdict(name, f"for {description} it returned {got!r}, expected {want}{hint}")
    return verdict(name, None)


# === notebook 08: speculative decoding ==============================================================

def check_expected_tokens_per_step(expected_tokens_per_step) -> bool:
    """Check a learner's expected_tokens_per_step(a, k): the mean tokens one verify step emits (the
    accepted drafts plus the target's own token) when each draft is accepted with probability a,
    against radarlab.spec_decode.theory.expected_tokens_per_step."""
    import math

    from radarlab.spec_decode.theory import expected_tokens_per_step as reference

    name = "expected_tokens_per_step"
    cases = [(0.5, 1), (0.8, 4), (0.0, 3), (0.6, 0), (1.0, 5), (0.95, 16), (0.3, 7)]
    for a, k in cases:
        want = reference(a, k)
        description = f"a={a}, k={k}"
        got, problem = call_learner(lambda: expected_tokens_per_step(a, k), description)
        if problem:
            return verdict(name, problem)
        try:
            got = float(got)
        except (TypeError, ValueError):
            return verdict(name, f"for {description} it returned {got!r}; expected a number, {want:.6g}")
        if not math.isclose(got, want, rel_tol=1e-9, abs_tol=1e-12):
            if math.isclose(got, want - 1, rel_tol=1e-9, abs_tol=1e-12):
                hint = " (count the target's own token too: a step emits at least 1 token)"
            elif a < 1 and math.isclose(got, 1 + a * k, rel_tol=1e-9):
                hint = " (draft i counts only if drafts 1..i-1 were accepted too: a^i, not a)"
            else:
                hint = " (1 + a + a^2 + ... + a^k)"
            return verdict(name, f"for {description} it returned {got:.6g}, expected {want:.6g}{hint}")
    return verdict(name, None)


def _spec_toy_cases():
    """(description, p [k+1, V], q [k, V]) for the rejection-sampler checker: distributions that
    overlap partly, and one where the draft puts mass where the target puts none."""
    import torch

    p = torch.tensor([[0.40, 0.25, 0.15, 0.10, 0.06, 0.04], [0.05, 0.05, 0.30, 0.30, 0.20, 0.10]],
                     dtype=torch.float64)
    q = torch.tensor([[0.10, 0.10, 0.30, 0.30, 0.10, 0.10]], dtype=torch.float64)
    return p, q


def check_verify_stochastic(verify_stochastic) -> bool:
    """Check a learner's verify_stochastic(target_probs, draft_token_ids, draft_probs, generator) ->
    emitted tokens: accept draft x with probability min(1, p(x)/q(x)), on the first rejection draw
    from max(0, p - q) renormalised and stop, and draw a bonus token from the last row if all drafts
    were accepted. Deterministic cases first, then a chi-square test of the first emitted token
    against p (6000 seeded steps; it rejects a sampler that resamples from p instead of the residual
    with probability above 0.99 at the 1e-3 level: radarlab.lab.chi_square.chi_square_power)."""
    import torch

    from radarlab.lab.chi_square import chi_square_test

    name = "verify_stochastic"

    def run(p, drafts, q, seed, description):
        gen = torch.Generator().manual_seed(seed)
        got, problem = call_learner(lambda: verify_stochastic(p.clone(), list(drafts),
                                                              None if q is None else q.clone(), gen), description)
        if problem:
            return None, problem
        try:
            tokens = [int(t) for t in got]
        except (TypeError, ValueError):
            return None, f"for {description} it returned {got!r}; expected a list of token ids"
        if not 1 <= len(tokens) <= len(drafts) + 1:
            return None, (f"for {description} it returned {tokens}: a verify step with {len(drafts)} drafts "
                          f"emits between 1 and {len(drafts) + 1} tokens")
        return tokens, None

    same = torch.tensor([[0.5, 0.3, 0.2]] * 3, dtype=torch.float64)
    tokens, problem = run(same, [0, 2], same[:2], 0, "p = q at every position, drafts [0, 2]")
    if problem:
        return verdict(name, problem)
    if tokens[:2] != [0, 2] or len(tokens) != 3:
        return verdict(name, f"for p = q at every position and drafts [0, 2] it returned {tokens}; when p = q "
                             f"every draft is accepted (min(1, p/q) = 1), then a bonus token is drawn: [0, 2, ?]")
    target = torch.tensor([[0.0, 0.7, 0.3], [0.2, 0.3, 0.5]], dtype=torch.float64)
    draft = torch.tensor([[0.6, 0.2, 0.2]], dtype=torch.float64)
    for seed in range(20):
        tokens, problem = run(target, [0], draft, seed, "p = [0, 0.7, 0.3], q = [0.6, 0.2, 0.2], draft 0")
        if problem:
            return verdict(name, problem)
        if len(tokens) != 1 or tokens[0] not in (1, 2):
            return verdict(name, f"for p = [0, 0.7, 0.3], q = [0.6, 0.2, 0.2] and draft 0 it returned {tokens}; "
                                 f"p(0) = 0, so the draft is always rejected and one token is drawn from the "
                                 f"residual max(0, p - q) = [0, 0.5, 0.1], renormalised: 1 or 2, never 0")
    # one-hot q (a draft without probabilities): accepted with probability p(x); never x on rejection
    one_hot_target = torch.tensor([[0.0, 1.0, 0.0], [0.2, 0.3, 0.5]], dtype=torch.float64)
    tokens, problem = run(one_hot_target, [1], None, 0, "p = [0, 1, 0], draft 1 without probabilities")
    if problem:
        return verdict(name, problem)
    if tokens[0] != 1 or len(tokens) != 2:
        return verdict(name, f"for p = [0, 1, 0] and draft 1 without probabilities (q one-hot on 1) it returned "
                             f"{tokens}; p(1)/q(1) = 1, so the draft is accepted and a bonus token follows")
    # the law of the first emitted token must be p
    p, q = _spec_toy_cases()
    n = 6000
    gen = torch.Generator().manual_seed(0)
    counts = torch.zeros(p.shape[1], dtype=torch.long)
    for i in range(n):
        x = int(torch.multinomial(q[0], 1, generator=gen))
        tokens, problem = run(p, [x], q, i, f"p = {p[0].tolist()}, q = {q[0].tolist()}, draft {x}")
        if problem:
            return verdict(name, problem)
        counts[tokens[0]] += 1
    _, pvalue = chi_square_test(counts, p[0])
    if pvalue < 1e-3:
        freq = [round(float(c) / n, 3) for c in counts]
        return verdict(name, f"over {n} verify steps with p = {p[0].tolist()} and drafts drawn from q = "
                             f"{q[0].tolist()}, the first emitted token had frequencies {freq}, not p "
                             f"(chi-square p-value {pvalue:.1e}); on rejection, draw from max(0, p - q) renormalised")
    return verdict(name, None)


def check_ngram_draft(ngram_draft) -> bool:
    """Check a learner's ngram_draft(token_ids, prompt_lookup_min, prompt_lookup_max, k) -> draft
    tokens against radarlab.spec_decode.ngram.ngram_draft (vLLM's prompt-lookup rule): the longest suffix
    n-gram (n from max down to min) that occurs earlier, its first (leftmost) occurrence, and the up
    to k tokens that followed it."""
    import random

    from radarlab.spec_decode.ngram import ngram_draft as reference

    name = "ngram_draft"
    rng = random.Random(8)
    cases = [  # (description, tokens, min, max, k)
        ("tokens=[1, 2, 3, 4, 1, 2], min=2, max=3, k=2 (the 2-gram [1, 2] occurred at the start)",
         [1, 2, 3, 4, 1, 2], 2, 3, 2),
        ("tokens=[2, 8, 1, 2, 9, 1, 2], min=1, max=3, k=3 (the longest match wins: [1, 2], not [2])",
         [2, 8, 1, 2, 9, 1, 2], 1, 3, 3),
        ("tokens=[1, 2, 8, 1, 2, 9, 1, 2], min=2, max=2, k=1 (two earlier occurrences: the first one is used)",
         [1, 2, 8, 1, 2, 9, 1, 2], 2, 2, 1),
        ("tokens=[3, 4, 5, 3, 4], min=2, max=4, k=5 (fewer tokens follow the match than k)", [3, 4, 5, 3, 4], 2, 4, 5),
        ("tokens=[1, 2, 3, 4, 5], min=1, max=3, k=3 (no repeat: no draft)", [1, 2, 3, 4, 5], 1, 3, 3),
        ("tokens=[7, 7, 7, 7], min=1, max=2, k=3 (overlapping matches)", [7, 7, 7, 7], 1, 2, 3),
        ("tokens=[1, 2, 3, 9, 2, 3, 1, 2, 3], min=2, max=3, k=2 (the 3-gram [1, 2, 3] beats the later 2-gram)",
         [1, 2, 3, 9, 2, 3, 1, 2, 3], 2, 3, 2),
        ("tokens=[4], min=1, max=2, k=2 (a single token)", [4], 1, 2, 2),
    ]
    for i in range(6):
        tokens = [rng.randint(0, 4) for _ in range(rng.randint(6, 30))]
        lo = rng.randint(1, 3)
        hi = lo + rng.randint(0, 2)
        k = rng.randint(1, 5)
        cases.append((f"random case {i + 1}: tokens={tokens}, min={lo}, max={hi}, k={k}", tokens, lo, hi, k))
    for description, tokens, lo, hi, k in cases:
        want = reference(tokens, lo, hi, k)
        got, problem = call_learner(lambda: ngram_draft(list(tokens), lo, hi, k), description)
        if problem:
            return verdict(name, problem)
        try:
            got = [int(t) for t in got]
        except (TypeError, ValueError):
            return verdict(name, f"for {description} it returned {got!r}; expected a list of token ids, {want}")
        if got != want:
            return verdict(name, f"for {description} it returned {got}, expected {want}")
    return verdict(name, None)


# === notebook 09: draft models ======================================================================
# acceptance_counts (accepted drafts per position from a verify log) and first_costly_batch (the batch
# at which a verify step stops costing about one decode step, on the roofline).

def reference_acceptance_counts(verify_log, k: int) -> tuple[list[int], float]:
    """(accepted per position, tokens per verify step) from (drafted, accepted) pairs, one per verify
    step of one request, counted by the engine's own counters (radarlab.spec_decode.metrics)."""
    from radarlab.spec_decode.metrics import SpecDecodingStats

    stats = SpecDecodingStats(k)
    steps = emitted = 0
    for drafted, accepted in verify_log:
        if drafted:
            stats.observe_draft(drafted, accepted)
        steps += 1
        emitted += accepted + 1  # the accepted drafts and the target's own token
    return stats.num_accepted_tokens_per_pos, emitted / steps if steps else float("nan")


def _verify_logs():
    import random

    rng = random.Random(9)
    hand = [(4, 4), (4, 0), (4, 2), (0, 0), (3, 1), (4, 3)]
    drafted = [rng.choice([0, 2, 5, 6, 6, 6]) for _ in range(300)]
    real_like = [(d, min(d, int(rng.expovariate(0.45)))) for d in drafted]
    return [("six verify steps with k = 4 (one without drafts, one with 3 drafts): "
             "[(4, 4), (4, 0), (4, 2), (0, 0), (3, 1), (4, 3)]", hand, 4),
            ("300 random verify steps with k = 6", real_like, 6),
            ("an empty log with k = 3", [], 3)]


def check_acceptance_counts(acceptance_counts) -> bool:
    """Check a learner's acceptance_counts(verify_log, k) -> (accepted_per_pos, tokens_per_verify_step):
    accepted_per_pos[i] counts the steps whose draft i was accepted (all drafts before it were too);
    tokens per verify step counts the accepted drafts plus the target's own token, over every step."""
    import math

    name = "acceptance_counts"
    for description, log, k in _verify_logs():
        want_pos, want_tps = reference_acceptance_counts(log, k)
        got, problem = call_learner(lambda: acceptance_counts(list(log), k), description)
        if problem:
            return verdict(name, problem)
        if not (isinstance(got, tuple) and len(got) == 2):
            return verdict(name, f"for {description} it returned {got!r}, expected a pair "
                                 "(accepted_per_pos, tokens_per_verify_step)")
        pos, tps = got
        pos = list(pos) if not isinstance(pos, (str, bytes)) and hasattr(pos, "__iter__") else pos
        if pos != want_pos:
            exact = [sum(1 for _, a in log if a == i + 1) for i in range(k)]
            hint = (" (that counts the steps that accepted exactly i + 1 drafts; position i counts every step "
                    "that accepted at least i + 1)") if pos == exact else ""
            return verdict(name, f"for {description}, accepted_per_pos is {pos!r}, expected {want_pos}{hint}")
        if not isinstance(tps, (int, float)) or isinstance(tps, bool) or not (
                math.isclose(tps, want_tps, rel_tol=1e-9) or (math.isnan(want_tps) and math.isnan(tps))):
            steps, accepted = len(log), sum(a for _, a in log)
            drafting = sum(1 for d, _ in log if d)
            hints = {}
            if steps:
                hints[accepted / steps] = " (add the target's own token: every verify step emits one more)"
            if drafting:
                hints[(accepted + drafting) / drafting] = " (steps without drafts are verify steps too, of one token)"
            hint = next((h for v, h in hints.items() if isinstance(tps, (int, float)) and math.isclose(tps, v)), "")
            if math.isnan(want_tps):
                hint = " (no steps: return float('nan'))"
            return verdict(name, f"for {description}, tokens per verify step is {tps!r}, expected {want_tps:.4g}{hint}")
    return verdict(name, None)


def reference_first_costly_batch(dims, k: int, context: int, peak_flops: float, bandwidth: float,
                                 dtype: str = "bf16", tolerance: float = 1.1, largest: int = 4096):
    """The smallest batch at which a verify step (k + 1 tokens per sequence) takes more than tolerance
    times a decode step of the same batch on the roofline, or None up to `largest`."""
    from radarlab.lab.roofline import decode_step

    for batch in range(1, largest + 1):
        plain = decode_step(dims, batch, context, dtype, dtype).time_bound_s(peak_flops, bandwidth)
        verify = decode_step(dims, batch, context, dtype, dtype, query_len=k + 1).time_bound_s(peak_flops, bandwidth)
        if verify > tolerance * plain:
            return batch
    return None


def check_first_costly_batch(first_costly_batch) -> bool:
    """Check a learner's first_costly_batch(dims, k, context, peak_flops, bandwidth, dtype, tolerance):
    the smallest batch whose verify step (each sequence's KV read once, k + 1 tokens of FLOPs) costs
    more than tolerance x a decode step of the same batch, on the roofline; None up to batch 4096."""
    from radarlab.lab.roofline import LLAMA_70B, TransformerDims, decode_step

    name = "first_costly_batch"
    course = TransformerDims(layers=30, hidden=576, intermediate=1536, heads=9, kv_heads=3, head_dim=64,
                             vocab=49152, tied_embeddings=True)
    cases = [  # (description, dims, k, context, peak FLOP/s, bandwidth B/s, dtype, tolerance)
        ("the course model in fp32, k = 4, context 256, on a CPU of 100 GFLOP/s and 20 GB/s",
         course, 4, 256, 100e9, 20e9, "fp32", 1.1),
        ("the 70B model in bf16, k = 3, context 1024, on an H100 (989 TFLOP/s, 3350 GB/s)",
         LLAMA_70B, 3, 1024, 989e12, 3350e9, "bf16", 1.1),
        ("the 70B model in bf16, k = 3, context 32768, on an H100", LLAMA_70B, 3, 32768, 989e12, 3350e9, "bf16", 1.1),
        ("the course model in bf16, k = 6, context 128, on an RTX 4090 (165 TFLOP/s, 1008 GB/s), tolerance 1.5",
         course, 6, 128, 165e12, 1008e9, "bf16", 1.5),
    ]
    for description, dims, k, context, peak, bw, dtype, tol in cases:
        want = reference_first_costly_batch(dims, k, context, peak, bw, dtype, tol)
        got, problem = call_learner(lambda: first_costly_batch(dims, k, context, peak, bw, dtype, tol), description)
        if problem:
            return verdict(name, problem)
        if got != want or isinstance(got, bool):
            ridge = peak / bw
            plain_bound = next((b for b in range(1, 4097) if decode_step(dims, b, context, dtype, dtype).intensity >= ridge), None)
            hint = ""
            if got == plain_bound:
                hint = (" (that is where a plain decode step turns compute-bound; a verify step does k + 1 "
                        "tokens of work per byte and turns sooner)")
            return verdict(name, f"for {description} it returned {got!r}, expected {want!r}{hint}")
    return verdict(name, None)
