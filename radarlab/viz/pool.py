"""Pictures of the paged KV cache: a block manager's state as data, and that data drawn with matplotlib.

Three steps, each callable without a browser (the widget in widgets.py only strings them together):
- apply_op(state, op): one scripted operation (allocate, append, fork, free) and what it did;
- pool_snapshot(state): the block tables and every physical block (holders, ref count, fill,
  cached or not) as plain data;
- draw_pool(snapshot, ax): the block tables on top, the physical pool below, a line from each
  table entry to the block it names, and an arrow for each copy-on-write.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Hashable, NamedTuple, Sequence

from radarlab.kvcache.block_pool import NoFreeBlocks
from radarlab.kvcache.kv_cache_manager import KVCacheManager
from radarlab.kvcache.sequence import Sequence as TokenSequence

SeqId = Hashable
OPS = ("allocate", "append", "fork", "free")


class PoolOp(NamedTuple):
    """One scripted step. allocate: arg is the prompt's token ids; append: the new token ids;
    fork: arg is the child's id (seq_id is the parent); free: no arg."""
    op: str
    seq_id: SeqId
    arg: object = None


# allocate, append, fork with copy-on-write, free, a prefix-cache hit, running out of blocks, and
# cached blocks revived after their owners were freed. Pool: 10 blocks of 4 slots.
DEFAULT_POOL_SCRIPT: tuple[PoolOp, ...] = (
    PoolOp("allocate", "A", (10, 11, 12, 13, 14, 15)),
    PoolOp("allocate", "B", (30, 31, 32)),
    PoolOp("append", "A", (16,)),
    PoolOp("append", "A", (17, 18)),
    PoolOp("fork", "A", "C"),
    PoolOp("append", "C", (50,)),
    PoolOp("append", "A", (19,)),
    PoolOp("free", "B"),
    PoolOp("allocate", "D", (10, 11, 12, 13, 60, 61)),
    PoolOp("free", "A"),
    PoolOp("allocate", "E", tuple(range(70, 98))),
    PoolOp("free", "C"),
    PoolOp("free", "D"),
    PoolOp("allocate", "E", (10, 11, 12, 13, 14, 15, 16, 17, 80, 81, 82)),
)
DEFAULT_POOL = dict(num_blocks=10, block_size=4)


@dataclass
class PoolState:
    """A block manager and the sequences it serves: the manager owns blocks, each sequence its tokens."""
    manager: KVCacheManager
    seqs: dict = field(default_factory=dict)


@dataclass
class OpResult:
    """What one operation did: a sentence for the caption, copy-on-write pairs, prefix-cache hits."""
    description: str
    copies: list[tuple[int, int]] = field(default_factory=list)
    num_computed_tokens: int = 0
    failed: bool = False


def apply_op(state: PoolState, op: PoolOp) -> OpResult:
    """Run one scripted operation. Running out of blocks is reported, not raised: it is part of the
    story (the manager changes nothing, and a scheduler would wait or preempt)."""
    name, seq, arg = op
    if name not in OPS:
        raise ValueError(f"op must be one of {OPS}, got {name!r}")
    manager = state.manager
    try:
        if name == "allocate":
            prompt = list(arg)
            sequence = TokenSequence(seq, prompt, manager.block_size)
            hit = manager.allocate(sequence)
            state.seqs[seq] = sequence
            table = manager.get_block_table(seq)
            text = f"allocate {seq}: {_a_or_an(len(prompt))} {len(prompt)}-token prompt gets blocks {table}"
            if hit:
                shared = table[:hit // manager.block_size]
                text += f"; the first {hit} tokens are a prefix-cache hit (blocks {shared} shared)"
            return OpResult(text, num_computed_tokens=hit)
        if name == "append":
            new = list(arg)
            sequence = state.seqs[seq]
            before = sequence.num_tokens
            if not manager.can_allocate_slots(sequence, len(new)):
                raise NoFreeBlocks(f"{len(new)} more tokens need a block and none is free")
            sequence.append_token_ids(new)
            copies = manager.allocate_slots(sequence, len(new))
            table = manager.get_block_table(seq)
            text = (f"append {len(new)} token{'s' * (len(new) != 1)} to {seq}: {before} -> "
                    f"{before + len(new)} tokens, blocks {table}")
            for src, dst in copies:
                text += f"; block {src} was shared, so {seq} writes into a copy, block {dst} (copy-on-write)"
            return OpResult(text, copies=copies)
        if name == "fork":
            child = TokenSequence(arg, state.seqs[seq].all_token_ids[:], manager.block_size)
            manager.fork(state.seqs[seq], child)
            state.seqs[arg] = child
            return OpResult(f"fork {seq} -> {arg}: {arg} shares all of {seq}'s blocks "
                            f"{manager.get_block_table(arg)}, "
                            f"nothing is copied (every ref count +1)")
        table = manager.get_block_table(seq)
        manager.free(state.seqs.pop(seq))
        return OpResult(f"free {seq}: each of its blocks {table} loses one reference; blocks at 0 are free "
                        f"(full ones stay cached until evicted)")
    except NoFreeBlocks as err:
        return OpResult(f"{name} {seq}: NoFreeBlocks ({err}); nothing changed", failed=True)


def run_pool_script(script: Sequence[PoolOp], num_blocks: int, block_size: int, steps: int | None = None,
                    enable_prefix_caching: bool = True) -> tuple[PoolState, OpResult | None]:
    """A fresh pool after the first `steps` operations of script (all by default), and the last result."""
    state = PoolState(KVCacheManager(num_blocks, block_size, enable_prefix_caching))
    result = None
    for op in script[:len(script) if steps is None else steps]:
        result = apply_op(state, op)
    return state, result


def _a_or_an(number: int) -> str:
    """The article before a number read aloud: "an 8-token", "an 11-token", "an 18-token", "a 6-token".
    Spoken numbers start with a vowel when they start with "eight", or with "eleven" or "eighteen" as
    their leading group of thousands (11, 11,000, ...)."""
    digits = str(number)
    vowel = digits[0] == "8" or (len(digits) % 3 == 2 and digits[:2] in ("11", "18"))
    return "an" if vowel else "a"


@dataclass
class BlockView:
    """One physical block. state: "free" (holds nothing), "cached" (free, but its content can still
    be hit), "used" (one holder) or "shared" (ref count > 1)."""
    block_id: int
    ref_count: int
    holders: tuple
    tokens: tuple  # token ids written in it (for a used block); empty otherwise
    num_filled: int
    state: str


@dataclass
class PoolSnapshot:
    num_blocks: int
    block_size: int
    tables: dict  # seq_id -> block ids in logical order
    num_tokens: dict  # seq_id -> tokens with slots
    blocks: list[BlockView]
    free_block_ids: list[int]  # never-cached free blocks, in the order allocate takes them
    evictable: list[int]  # free but cached, least recently freed first (evicted first)
    copies: list[tuple[int, int]] = field(default_factory=list)
    caption: str = ""

    @property
    def num_used_blocks(self) -> int:
        return sum(b.ref_count > 0 for b in self.blocks)


def pool_snapshot(state: PoolState, copies: Sequence[tuple[int, int]] = (),
                  caption: str = "") -> PoolSnapshot:
    """The pool's state as plain data (nothing in it refers back to the manager or the sequences)."""
    manager = state.manager
    alloc = manager.block_pool
    bs = manager.block_size
    holders: dict[int, list] = {}
    tokens: dict[int, tuple] = {}
    for seq, table in manager.block_tables.items():
        for i, block_id in enumerate(table.block_ids):
            holders.setdefault(block_id, []).append(seq)
            written = state.seqs[seq].all_token_ids[i * bs:min((i + 1) * bs, table.num_slots)]
            tokens[block_id] = max(tokens.get(block_id, ()), tuple(written), key=len)
    evictable = list(alloc.evictable)
    blocks = []
    for b in range(manager.num_blocks):
        ref = alloc.ref_count(b)
        if ref:
            state = "shared" if ref > 1 else "used"
            filled = len(tokens.get(b, ()))
        else:
            state = "cached" if b in alloc.evictable else "free"
            filled = bs if state == "cached" else 0
        blocks.append(BlockView(b, ref, tuple(holders.get(b, ())), tokens.get(b, ()), filled, state))
    return PoolSnapshot(manager.num_blocks, bs,
                        {s: list(t.block_ids) for s, t in manager.block_tables.items()},
                        {s: t.num_slots for s, t in manager.block_tables.items()},
                        blocks, list(alloc.free_block_ids), evictable, list(copies), caption)


PALETTE = ("tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple", "tab:brown",
           "tab:pink", "tab:olive")
SHARED_COLOR = "0.45"
CACHED_COLOR = "0.85"


def sequence_colors(seq_ids: Sequence[SeqId]) -> dict:
    """A fixed color per sequence, in order (the widget passes every id of its script, so a
    sequence keeps its color after others are freed)."""
    out: dict = {}
    for s in seq_ids:
        if s not in out:
            out[s] = PALETTE[len(out) % len(PALETTE)]
    return out


# draw_pool's layout, in data units (a slot is 1 x 1): where things go, so that the picture's extent is
# known before drawing and a widget can give every step the same size.
LABEL_PAD = 7.0  # room on the left for row labels
BLOCK_GAP = 1.0  # between two blocks of the pool
TABLE_Y = 3.0  # the lowest block-table row
ROW_PITCH = 1.6  # between block-table rows
BOTTOM = -5.6  # below the pool: block ids, ref counts, copy arrows, the free list
TOKEN_FONT_SIZE = 9  # points: at 100 dpi a digit is about 9 pixels tall
PIXELS_PER_SLOT = 18  # a slot's side in the stepper's PNG: room for a two-digit token id at 9 points
RENDER_DPI = 100


def pool_extent(num_blocks: int, block_size: int, num_rows: int) -> tuple[float, float, float, float]:
    """draw_pool's data limits (x0, x1, y0, y1) for a pool and at most `num_rows` block tables."""
    top = TABLE_Y + ROW_PITCH * max(num_rows, 1)
    return -LABEL_PAD - 0.5, num_blocks * (block_size + BLOCK_GAP) + 0.5, BOTTOM, top + ROW_PITCH


def pool_image_size(num_blocks: int, block_size: int, num_rows: int,
                    pixels_per_slot: int = PIXELS_PER_SLOT) -> tuple[int, int]:
    """(width, height) in pixels of a picture whose slots are pixels_per_slot wide."""
    x0, x1, y0, y1 = pool_extent(num_blocks, block_size, num_rows)
    return round((x1 - x0) * pixels_per_slot), round((y1 - y0) * pixels_per_slot)


def max_table_rows(script: Sequence[PoolOp], num_blocks: int, block_size: int,
                   enable_prefix_caching: bool = True) -> int:
    """The most sequences holding blocks at once while the script runs: the tallest picture it needs."""
    state = PoolState(KVCacheManager(num_blocks, block_size, enable_prefix_caching))
    most = 0
    for op in script:
        apply_op(state, op)
        most = max(most, len(state.manager.block_tables))
    return most


DIGIT_WIDTH_EM = 0.636  # a digit's advance in matplotlib's default font (DejaVu Sans), in ems


def _slot_points(ax, extent: tuple[float, float, float, float]) -> float:
    """A slot's side in points once the axes keeps its aspect equal: the tighter of width and height."""
    x0, x1, y0, y1 = extent
    box = ax.get_position()
    width_in, height_in = ax.figure.get_size_inches()
    return 72 * min(box.width * width_in / (x1 - x0), box.height * height_in / (y1 - y0))


def _token_font_size(label: str, slot_points: float) -> float:
    """TOKEN_FONT_SIZE, or smaller where the id would not fit in 90% of its slot (long ids, small figures)."""
    return min(TOKEN_FONT_SIZE, 0.9 * slot_points / (DIGIT_WIDTH_EM * len(label)))


def draw_pool(snapshot: PoolSnapshot, ax, colors: dict | None = None, show_tokens: bool = True,
              num_rows: int | None = None) -> None:
    """Draw block tables (top) and the physical pool (bottom) on one matplotlib Axes.

    A block's slots are unit squares; filled slots are colored by their holder (gray when shared),
    reserved but unwritten ones are white. Lines join each table entry to its physical block.
    num_rows fixes the room for block tables (default: this snapshot's), so that pictures of several
    states of one pool have the same extent (pool_extent).
    """
    from matplotlib.patches import FancyArrowPatch, Rectangle

    bs, n = snapshot.block_size, snapshot.num_blocks
    colors = colors or sequence_colors(list(snapshot.tables))
    width = bs + BLOCK_GAP
    pool_y = 0.0
    label_pad = LABEL_PAD
    extent = pool_extent(n, bs, max(len(snapshot.tables), num_rows or 0))
    slot_points = _slot_points(ax, extent)

    def slot_box(x, y, face, edge="black"):
        ax.add_patch(Rectangle((x, y), 1, 1, facecolor=face, edgecolor=edge, lw=0.8))

    # The physical pool.
    ax.text(-label_pad, pool_y + 0.5, "pool", ha="left", va="center", fontsize=9, weight="bold")
    for b in snapshot.blocks:
        x0 = b.block_id * width
        for off in range(bs):
            if b.state == "free":
                slot_box(x0 + off, pool_y, "white", edge="0.6")
            elif b.state == "cached":
                slot_box(x0 + off, pool_y, CACHED_COLOR, edge="0.5")
            else:
                color = SHARED_COLOR if b.state == "shared" else colors.get(b.holders[0], "tab:gray")
                filled = off < b.num_filled
                slot_box(x0 + off, pool_y, color if filled else "white")
                if filled and show_tokens:
                    label = str(b.tokens[off])
                    ax.text(x0 + off + 0.5, pool_y + 0.5, label, ha="center", va="center",
                            fontsize=_token_font_size(label, slot_points), color="white")
        ax.text(x0 + bs / 2, pool_y - 0.35, f"#{b.block_id}", ha="center", va="top", fontsize=8)
        status = {"free": "free", "cached": "cached"}.get(b.state, f"ref {b.ref_count}")
        ax.text(x0 + bs / 2, pool_y - 1.05, status, ha="center", va="top", fontsize=8,
                color="black" if b.ref_count else "0.4")

    # Copy-on-write arrows under the pool.
    for src, dst in snapshot.copies:
        ax.add_patch(FancyArrowPatch((src * width + bs / 2, pool_y - 1.9),
                                     (dst * width + bs / 2, pool_y - 1.9),
                                     connectionstyle="arc3,rad=0.35", arrowstyle="-|>", mutation_scale=12,
                                     color="tab:red", lw=1.5))
        ax.text((src + dst) / 2 * width + bs / 2, pool_y - 3.4, f"copy {src} -> {dst}", ha="center",
                va="top", fontsize=8, color="tab:red")

    # The block tables, one row per sequence, above the pool.
    rows = list(snapshot.tables.items())
    for r, (seq, table) in enumerate(rows):
        y = pool_y + TABLE_Y + ROW_PITCH * (len(rows) - 1 - r)
        color = colors.get(seq, "tab:gray")
        ax.text(-label_pad, y + 0.5, f"{seq} ({snapshot.num_tokens[seq]} tok)", ha="left", va="center",
                fontsize=8, color=color, weight="bold")
        for i, block_id in enumerate(table):
            x = i * 1.6
            ax.add_patch(Rectangle((x, y), 1.4, 1, facecolor="white", edgecolor=color, lw=1.5))
            ax.text(x + 0.7, y + 0.5, str(block_id), ha="center", va="center", fontsize=8)
            ax.plot([x + 0.7, block_id * width + bs / 2], [y, pool_y + 1.05], color=color, lw=0.8, alpha=0.6)
    top = pool_y + TABLE_Y + ROW_PITCH * max(len(rows), 1)
    if rows:
        ax.text(-label_pad, top + 0.3, "block tables (logical block i -> physical block id)", fontsize=8,
                ha="left", va="bottom")
    free_text = f"free list {snapshot.free_block_ids}"
    if snapshot.evictable:
        free_text += f"   cached, evictable (LRU first) {snapshot.evictable}"
    ax.text(-label_pad, pool_y - 4.6, free_text, fontsize=8, ha="left", va="top")
    x0, x1, y0, y1 = extent
    ax.set_xlim(x0, x1)
    ax.set_ylim(y0, y1)
    ax.set_aspect("equal")
    ax.axis("off")
    if snapshot.caption:
        ax.set_title(snapshot.caption, fontsize=9, loc="left", wrap=True)
