"""The block-pool stepper and the pool pictures, driven from Python: no browser needed."""
from __future__ import annotations

import io
import struct

import pytest
from matplotlib.figure import Figure

from radarlab.kvcache.kv_cache_manager import KVCacheManager
from radarlab.viz.pool import (
    DEFAULT_POOL_SCRIPT,
    PIXELS_PER_SLOT,
    TOKEN_FONT_SIZE,
    PoolOp,
    PoolState,
    apply_op,
    draw_pool,
    max_table_rows,
    pool_image_size,
    pool_snapshot,
    run_pool_script,
    sequence_colors,
)
from radarlab.viz.widgets import block_pool_stepper


def states(snapshot):
    return {b.block_id: (b.state, b.ref_count, b.num_filled) for b in snapshot.blocks if b.state != "free"}


def test_stepper_shows_each_step_of_the_script():
    w = block_pool_stepper()
    assert w.position == 0 and w.back_button.disabled and not w.next_button.disabled
    assert "empty pool of 10 blocks x 4 slots" in w.caption.value
    assert w.snapshot.tables == {} and w.snapshot.num_used_blocks == 0
    empty_png = bytes(w.image.value)
    assert empty_png.startswith(b"\x89PNG")

    w.next_button.click()  # allocate A, 6 tokens
    assert w.position == 1 and not w.back_button.disabled
    assert "step 1/14" in w.caption.value and "gets blocks [0, 1]" in w.caption.value
    assert w.snapshot.tables == {"A": [0, 1]} and w.snapshot.num_tokens == {"A": 6}
    assert states(w.snapshot) == {0: ("used", 1, 4), 1: ("used", 1, 2)}
    assert w.snapshot.blocks[0].tokens == (10, 11, 12, 13)
    assert bytes(w.image.value).startswith(b"\x89PNG") and bytes(w.image.value) != empty_png

    for _ in range(4):  # B, two appends to A, then fork A -> C
        w.next_button.click()
    assert w.snapshot.tables == {"A": [0, 1, 3], "B": [2], "C": [0, 1, 3]}
    assert {b: states(w.snapshot)[b][:2] for b in (0, 1, 3)} == {0: ("shared", 2),
                                                                 1: ("shared", 2), 3: ("shared", 2)}
    assert "nothing is copied" in w.caption.value

    w.next_button.click()  # C writes into the shared, partly filled block 3: copy-on-write
    assert w.snapshot.copies == [(3, 4)] and "copy-on-write" in w.caption.value
    assert w.snapshot.tables["C"] == [0, 1, 4] and w.snapshot.blocks[4].tokens == (18, 50)
    assert states(w.snapshot)[3] == ("used", 1, 1)

    w.go(11)  # the big prompt does not fit: reported in the caption, nothing changes
    assert "NoFreeBlocks" in w.caption.value and "nothing changed" in w.caption.value
    assert "E" not in w.snapshot.tables

    w.go(13)  # everyone freed: full blocks stay cached (evictable), partial ones go to the free list
    assert w.snapshot.tables == {} and w.snapshot.num_used_blocks == 0
    assert sorted(w.snapshot.evictable) == [0, 1] and states(w.snapshot) == {0: ("cached", 0, 4),
                                                                             1: ("cached", 0, 4)}

    w.next_button.click()  # E's prompt starts with A's 8 tokens: both cached blocks are revived
    assert w.position == 14 and w.next_button.disabled
    assert w.snapshot.tables == {"E": [0, 1,
                                       6]} and "first 8 tokens are a prefix-cache hit" in w.caption.value
    w.next_button.click()  # at the end: stays there
    assert w.position == 14

    w.back_button.click()  # back replays the script: the same state as going there directly
    assert w.position == 13 and states(w.snapshot) == {0: ("cached", 0, 4), 1: ("cached", 0, 4)}
    w.reset_button.click()
    assert w.position == 0 and w.snapshot.tables == {} and bytes(w.image.value) == empty_png


def test_sequences_keep_their_colors():
    w = block_pool_stepper()
    assert list(w.colors) == ["A", "B", "C", "D", "E"] and len(set(w.colors.values())) == 5


def test_custom_script_and_pool():
    script = [PoolOp("allocate", "x", [1, 2, 3]), PoolOp("fork", "x", "y"), PoolOp("append", "y", [4])]
    w = block_pool_stepper(script, num_blocks=4, block_size=2)
    w.go(len(script))
    assert w.snapshot.tables == {"x": [0, 1], "y": [0, 2]} and w.snapshot.copies == [(1, 2)]


def test_snapshot_is_plain_data():
    state = PoolState(KVCacheManager(6, 4))
    apply_op(state, PoolOp("allocate", "p", [1, 2, 3, 4, 5]))
    apply_op(state, PoolOp("fork", "p", "q"))
    snap = pool_snapshot(state)
    apply_op(state, PoolOp("free", "p"))
    assert snap.tables == {"p": [0, 1], "q": [0, 1]}  # unchanged by later manager calls
    assert snap.blocks[0].holders == ("p", "q") and snap.blocks[1].tokens == (5,)
    assert snap.free_block_ids == [2, 3, 4, 5] and snap.evictable == []


def test_draw_pool_labels_every_block_and_table_entry():
    state, result = run_pool_script(DEFAULT_POOL_SCRIPT, 10, 4, steps=6)
    snap = pool_snapshot(state, result.copies)
    fig = Figure()
    ax = fig.subplots()
    draw_pool(snap, ax, sequence_colors("ABCDE"))
    texts = [t.get_text() for t in ax.texts]
    assert all(f"#{b}" in texts for b in range(10))
    assert texts.count("ref 2") == 2 and texts.count("free") == 5  # blocks 0, 1 shared; 5..9 free
    assert "copy 3 -> 4" in texts and "A (9 tok)" in texts and "C (10 tok)" in texts
    assert "free list [5, 6, 7, 8, 9]" in texts
    fig.savefig(io.BytesIO(), format="png")


def test_bad_op_raises():
    with pytest.raises(ValueError, match="op must be one of"):
        apply_op(PoolState(KVCacheManager(4, 4)), PoolOp("alloc", "a", [1]))


def png_size(png: bytes) -> tuple[int, int]:
    """Width and height from a PNG's IHDR chunk."""
    assert png.startswith(b"\x89PNG\r\n\x1a\n") and png[12:16] == b"IHDR"
    return struct.unpack(">II", png[16:24])


def test_every_step_has_the_same_picture_size_shown_one_to_one():
    w = block_pool_stepper()
    assert w.num_rows == 3  # A, B and C after the fork: never more than three tables at once
    sizes = set()
    for position in range(len(w.script) + 1):
        w.go(position)
        sizes.add(png_size(bytes(w.image.value)))
    assert sizes == {w.image_size} == {pool_image_size(10, 4, 3)}
    assert w.image.width == str(w.image_size[0])  # displayed at the PNG's own width: no scaling


def test_token_ids_are_legible_and_fit_their_slots():
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    w = block_pool_stepper()
    w.go(1)  # A's 6 tokens: 10 .. 15
    fig = w.figure()
    renderer = FigureCanvasAgg(fig).get_renderer()
    tokens = [t for t in fig.axes[0].texts if t.get_text() in {str(i) for i in range(10, 16)}
              and t.get_color() == "white"]
    assert len(tokens) == 6
    for text in tokens:
        box = text.get_window_extent(renderer)
        assert text.get_fontsize() >= TOKEN_FONT_SIZE and box.height >= 10  # pixels in the PNG, shown 1:1
        assert box.width < PIXELS_PER_SLOT


def test_caption_is_shown_once():
    w = block_pool_stepper()
    w.go(5)
    sentence = "nothing is copied (every ref count +1)"
    assert w.caption.value.count(sentence) == 1
    fig = w.figure()
    drawn = [fig.axes[0].get_title(loc=loc) for loc in ("left", "center", "right")]
    drawn += [t.get_text() for t in fig.axes[0].texts]
    assert not any(sentence in text for text in drawn)


def test_num_rows_fixes_the_extent():
    script = DEFAULT_POOL_SCRIPT
    limits = set()
    for steps in (0, 1, 5):
        state, _ = run_pool_script(script, 10, 4, steps)
        ax = Figure().subplots()
        draw_pool(pool_snapshot(state), ax, num_rows=3)
        limits.add((ax.get_xlim(), ax.get_ylim()))
    assert limits == {((-7.5, 50.5), (-5.6, 9.4))}
    assert max_table_rows(script, 10, 4) == 3
    assert max_table_rows([PoolOp("allocate", s, [1]) for s in "abcde"], 10, 4) == 5


@pytest.mark.parametrize("figsize, prompt",
                         [((11, 3.8), [10, 11, 12, 13]), ((10.44, 2.7), [100, 255, 7, 999])])
def test_token_ids_stay_inside_their_slots(figsize, prompt):
    """In a smaller figure, or with longer ids, the font shrinks rather than spill into the next slot."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    state = PoolState(KVCacheManager(10, 4))
    apply_op(state, PoolOp("allocate", "p", prompt))
    fig = Figure(figsize=figsize)
    ax = fig.subplots()
    draw_pool(pool_snapshot(state), ax)
    renderer = FigureCanvasAgg(fig).get_renderer()
    slot = ax.transData.transform((1, 0))[0] - ax.transData.transform((0, 0))[0]  # pixels
    tokens = [t for t in ax.texts if t.get_color() == "white"]
    assert [t.get_text() for t in tokens] == [str(i) for i in prompt]
    assert all(t.get_window_extent(renderer).width < 0.95 * slot for t in tokens)
