"""Checkers of notebook 04 (paged attention kernels): reshape_and_cache, the store-KV kernel, the
online-softmax update."""
from __future__ import annotations

from radarlab.checks.common import kernel_error, raised_not_written, verdict


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
        ("a bfloat16 pool with float32 k and v (store in the pool's dtype)", 2, 4, 2, 4,
         [1, 6], torch.bfloat16),
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
                return verdict(name, f"for {description} {pool} became {tuple(got.shape)} {got.dtype}; write "
                                     f"into the pool in place, keeping its shape {shape} and dtype {dtype}")
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


def check_store_kv_kernel(store_kv) -> bool:
    """Check a learner's store-KV Triton kernel through its launcher store_kv(k, v, k_cache, v_cache,
    slot_mapping), against radarlab.kvcache.paged_cache.reshape_and_cache, bit for bit.

    A kernel writes through raw pointers, so a wrong address lands outside the pool instead of raising.
    Each pool is therefore a view into a bigger buffer: one block of guard before it (where slot -1
    lands if padding is not skipped) and num_blocks * block_size blocks after it (where a slot used as
    a block id lands). Everything outside the pool must keep its marker value, and so must every slot
    no token maps to. Few tokens per case: under TRITON_INTERPRET=1 every program runs in Python."""
    import torch

    from radarlab.attention.kv_write import reshape_and_cache as reference
    from radarlab.device import default_device

    name = "store_kv_kernel"
    device = default_device()
    gen = torch.Generator().manual_seed(6)
    cases = [  # (description, num_blocks, block_size, kv_heads, head_dim, slots)
        ("3 tokens into slots [5, 6, 7] of a pool of 3 blocks of 4 (block 1, rows 1-3), 2 KV heads, "
         "head_dim 16",
         3, 4, 2, 16, [5, 6, 7]),
        ("4 tokens with slots [9, -1, 2, -1] in 3 blocks of 4 (-1 is padding: nothing is written for it)",
         3, 4, 2, 16, [9, -1, 2, -1]),
        ("block size 1 (the slot is the block id), slots [3, 0, 2], 3 KV heads (padded to 4 lanes), "
         "head_dim 16",
         4, 1, 3, 16, [3, 0, 2]),
        ("5 tokens at slots [37, 15, -1, 0, 63] of 4 blocks of 16, 3 KV heads, head_dim 32",
         4, 16, 3, 32, [37, 15, -1, 0, 63]),
        ("head_dim 24 (padded to 32 lanes), 2 KV heads, slots [6, 1, -1] of 2 blocks of 4", 2, 4,
         2, 24, [6, 1, -1]),
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
            if raised_not_written(err):
                return verdict(name, "the kernel is not written yet (it raises NotImplementedError)")
            while err.__cause__ is not None:  # the learner's error, not Triton's wrapper around it
                err = err.__cause__
            hint = (" (the interpreter cannot store under a mask that combines a block with a single value, "
                    "such as (d < head_dim) & (slot >= 0); skip padding with `if slot < 0: return` instead)"
                    if "mask has unsupported dtype" in str(err) else "")
            return verdict(name, f"for {description} it raised {type(err).__name__}: {err}{hint}")
        for pool, buffer in buffers.items():
            buffer = buffer.cpu()
            before, after = buffer[:1] != marker, buffer[1 + num_blocks:] != marker
            if before.any():
                hint = (f"slot -1 is padding: skip it, or its block -1 // {bs} and row -1 % {bs} point "
                        f"before the pool" if -1 in slots else "check the destination address")
                return verdict(name, f"for {description} it wrote {int(before.sum())} values into the memory "
                                     f"just before {pool} ({hint})")
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
            shown = ", ".join(f"{x:.3g}" for x in g[block, row, head][:3].tolist())
            return verdict(name, f"for {description}, {pool}[{block}, {row}, {head}] (slot {slot}, KV head "
                                 f"{head}) holds [{shown}, ...] instead of {what}{hint}")
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
                  torch.tensor([[100.0, 98.0, 101.0, 0.0]]),
                  torch.tensor([[1.0], [2.0], [3.0], [4.0]]), [2, 2]))
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
            hint = (" (exp of a score near 100 overflows float32: exponentiate score - m, never the raw "
                    "score)"
                    if scores.max() > 80 else "")
            return verdict(name, f"for {description} l or acc holds inf or NaN{hint}")
        if not torch.allclose(m, want_m, rtol=1e-6, atol=1e-6):
            return verdict(name, f"for {description} m ended as {m.tolist()}, expected the largest score "
                                 f"{want_m.tolist()}")
        if not torch.allclose(l, want_l, rtol=1e-5, atol=1e-6) or not torch.allclose(acc, want_acc, rtol=1e-5,
                                                                                       atol=1e-5):
            out = acc / l[:, None]
            if torch.allclose(out, attention, rtol=1e-4, atol=1e-5):
                return verdict(name, f"for {description} acc / l is right but l ended as {l.tolist()} "
                                     f"(expected {want_l.tolist()}): keep l = sum of exp(score - m) and acc "
                                     f"unnormalised, and divide once at the end")
            hint = (" (when the maximum grows, scale the old l and acc by exp(m_old - m_new))"
                    if len(sizes) > 1 else "")
            return verdict(name, f"for {description} acc / l is {out.flatten()[:4].tolist()}, but full "
                                 f"softmax attention gives {attention.flatten()[:4].tolist()}{hint}")
    return verdict(name, None)


def _decode_diagnosis(b, got, tile_n: int) -> str:
    """Which plausible mistake explains a wrong decode output: each is computed in torch from the
    batch's unpaged K and V and compared with what the kernel returned."""
    import torch

    if got.isnan().any():
        return ("NaN came out: positions past seq_len, and slots no block table names, hold NaN here. "
                "Mask the loads to pos < seq_len, score those lanes -inf, and take each position's block "
                "from block_tables[seq, p // BLOCK_SIZE]")
    heads, kv_heads = b.q.shape[1], b.k_cache.shape[2]
    group = heads // kv_heads

    def attend(kv_of_head, scale):
        out = torch.empty_like(b.q, dtype=torch.float32)
        for seq, (k, v) in enumerate(zip(b.keys, b.values)):
            for h in range(heads):
                s = (b.q[seq, h].float() @ k[:, kv_of_head(h)].float().T) * scale
                out[seq, h] = torch.softmax(s, -1) @ v[:, kv_of_head(h)].float()
        return out

    def near(x):
        return bool(torch.allclose(got.float(), x, atol=1e-4, rtol=1e-3))

    if group > 1 and near(attend(lambda h: h % kv_heads, b.scale)):
        return ("query head h reads KV head h // GROUP (this program's heads are kv_head * GROUP + g), not "
                "h % num_kv_heads")
    if near(attend(lambda h: h // group, 1.0)):
        return "the scores are missing the scale: multiply q (or q . k) by scale"
    if max(b.seq_lens.tolist()) > tile_n:
        return ("the context spans several tiles: when a tile raises the running max, rescale acc and l by "
                "exp(m_old - m_new) before adding the tile")
    return "position p lives in block block_tables[seq, p // BLOCK_SIZE], row p % BLOCK_SIZE"


def check_paged_decode_kernel(kernel) -> bool:
    """Check a learner's paged-decode Triton kernel (the signature of triton_paged._paged_decode_kernel),
    launched by triton_paged_decode(..., kernel=kernel) with tiles of 8 positions, against
    attention_reference on the unpaged K and V; a wrong output is matched against plausible mistakes
    (unmasked reads, the GQA mapping, the scale, the rescale across tiles, the block-table lookup)."""
    import torch

    from radarlab.attention.triton_paged import triton_paged_decode
    from radarlab.device import default_device
    from radarlab.lab.kernel_bench import random_paged_batch

    name = "paged_decode_kernel"
    tile_n = 8
    cases = [  # (description, seq_lens, block_size, heads, kv_heads, head_dim)
        ("one sequence of 3 tokens in one block of 4, 2 query heads over 2 KV heads, head_dim 16",
         [3], 4, 2, 2, 16),
        ("sequences of 8 and 11 tokens in blocks of 4 (block tables shuffled), 2 heads over 2 KV heads",
         [8, 11], 4, 2, 2, 16),
        ("a sequence of 29 tokens (4 tiles of 8 positions), block size 16", [29], 16, 2, 2, 16),
        ("block size 1 (every position its own block), sequences of 1, 5 and 9 tokens",
         [1, 5, 9], 1, 2, 2, 16),
        ("GQA: 4 query heads over 2 KV heads, sequences of 6 and 13 tokens, block size 4",
         [6, 13], 4, 4, 2, 16),
        ("the course model's heads: 9 over 3, head_dim 64 (a group of 3 padded to 4 lanes), 20 and 7 tokens",
         [20, 7], 4, 9, 3, 64),
    ]
    device = default_device()
    for i, (description, lens, bs, heads, kv_heads, dim) in enumerate(cases):
        b = random_paged_batch(lens, None, bs, heads, kv_heads, dim, seed=20 + i, device=device)
        want = b.reference().cpu()
        # Table entries past a sequence's blocks name a spare block of NaN, so that a kernel reading
        # past seq_len unmasked reads NaN (and shows it) rather than an address outside the pool.
        spare = min(set(range(b.k_cache.shape[0])) - set(b.block_tables.flatten().tolist()))
        width = -(-(max(lens) + tile_n) // bs) + 1
        tables = torch.full((len(lens), width), spare, dtype=b.block_tables.dtype, device=device)
        for seq, n in enumerate(lens):
            tables[seq, :-(-n // bs)] = b.block_tables[seq, :-(-n // bs)]
        try:
            got = triton_paged_decode(b.q, b.k_cache, b.v_cache, tables, b.seq_lens, b.scale,
                                      tile_n=tile_n, kernel=kernel).cpu()
        except Exception as err:  # a learner's bug should read as a counterexample, not a traceback
            return kernel_error(name, err, description)
        bad = ~torch.isclose(got, want, atol=1e-5, rtol=1e-4)
        if bad.any():
            seq, head = (int(x) for x in bad.any(-1).nonzero()[0])
            wrong = sorted({int(h) for h in bad.any(-1).nonzero()[:, 1]})
            return verdict(name, f"for {description}: sequence {seq}, head {head} is wrong (wrong heads: "
                                 f"{wrong}); {_decode_diagnosis(b, got, tile_n)}")
    return verdict(name, None)
