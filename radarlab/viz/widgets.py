"""Interactive controls for the notebooks. The arithmetic lives in radarlab (kvcache.memory, viz.pool), so
tests can change a control's value in plain Python and read the label, with no browser involved."""
from __future__ import annotations

import html
import io

import ipywidgets as widgets

from radarlab.kvcache.memory import KV_DTYPES, KVModelShape, kv_report, stored_shapes, summary_line
from radarlab.kvcache.model_config import stored_name
from radarlab.util import require_int

TOKEN_STEPS = tuple(2**k for k in range(18))  # 1 .. 131,072: the tokens slider moves in powers of two
CUSTOM = ""  # the model dropdown's value when the sliders match no chosen model


def token_options(tokens: int) -> list[tuple[str, int]]:
    """(label, value) pairs for the tokens slider: powers of two, plus `tokens` itself if it is not one.
    A linear slider over 131,072 tokens on 400 pixels moves 300 tokens a pixel; a log one stays usable."""
    values = sorted(set(TOKEN_STEPS) | {require_int("tokens", tokens)})
    return [(f"{t:,}", t) for t in values]


class KVCalculator(widgets.VBox):
    """A KV-cache calculator: model shape, context, format and GPU in; bytes, GB and streams out.

    `controls` maps each input's name (kv_report's parameter names) to its widget; `model` is the
    dropdown of stored configs (choosing one sets layers, KV heads and head dim; moving those sliders
    away from it shows "custom"); `result` is the Label with the one-line answer, or what is wrong."""

    def __init__(self, layers: int = 80, kv_heads: int = 8, head_dim: int = 128, tokens: int = 32768,
                 kv_dtype: str = "fp16", group_size: int = 128, gpu_mem_gb: float = 48.0,
                 weights_gb: float = 0.0, model: str | None = None) -> None:
        self.shapes = stored_shapes()
        style = {"description_width": "110px"}
        layout = widgets.Layout(width="420px")
        self.controls = {
            "layers": widgets.IntSlider(value=layers, min=1, max=max(128, layers), description="layers",
                                        style=style, layout=layout),
            "kv_heads": widgets.IntSlider(value=kv_heads, min=1, max=max(64, kv_heads),
                                          description="KV heads",
                                          style=style, layout=layout),
            "head_dim": widgets.Dropdown(options=sorted({64, 80, 96, 128, 256, head_dim}
                                                        | {s.head_dim for s in self.shapes.values()}),
                                         value=head_dim, description="head dim", style=style),
            "tokens": widgets.SelectionSlider(options=token_options(tokens), value=tokens,
                                              description="tokens",
                                              style=style, layout=layout),
            "kv_dtype": widgets.Dropdown(options=list(KV_DTYPES), value=kv_dtype,
                                         description="KV dtype", style=style),
            "group_size": widgets.Dropdown(options=sorted({16, 32, 64, 128, group_size}), value=group_size,
                                           description="group size", style=style),
            "gpu_mem_gb": widgets.BoundedFloatText(value=gpu_mem_gb, min=0.0, max=10000.0, step=1.0,
                                                   description="GPU memory GB", style=style),
            "weights_gb": widgets.BoundedFloatText(value=weights_gb, min=0.0, max=10000.0, step=1.0,
                                                   description="weights GB", style=style),
        }
        self.model = widgets.Dropdown(options=[("custom", CUSTOM)] + [(name, name) for name in self.shapes],
                                      value=self._matching_model(), description="model", style=style)
        self.result = widgets.Label(layout=widgets.Layout(width="auto"))
        self._choosing = False  # True while a model choice moves the shape sliders
        for control in self.controls.values():
            control.observe(self._update, names="value")
        self.model.observe(self._choose_model, names="value")
        super().__init__([self.model] + list(self.controls.values()) + [self.result])
        if model is not None:  # a stored config's shape wins over the layers, kv_heads and head_dim given
            if stored_name(model) is None:
                raise ValueError(f"model must be one of {', '.join(self.shapes)} (or None), got {model!r}")
            self.model.value = stored_name(model)
        self._update()

    def values(self) -> dict:
        return {name: control.value for name, control in self.controls.items()}

    def _shape(self) -> KVModelShape:
        v = self.values()
        return KVModelShape(v["layers"], v["kv_heads"], v["head_dim"])

    def _matching_model(self) -> str:
        """The one stored model with the sliders' shape, else custom (two models may share a shape)."""
        names = [name for name, shape in self.shapes.items() if shape == self._shape()]
        return names[0] if len(names) == 1 else CUSTOM

    def _choose_model(self, change) -> None:
        if change["new"] == CUSTOM:
            return
        shape = self.shapes[change["new"]]
        self._choosing = True
        try:
            self.controls["layers"].value = shape.layers
            self.controls["kv_heads"].value = shape.kv_heads
            self.controls["head_dim"].value = shape.head_dim
        finally:
            self._choosing = False
        self._update()

    def _update(self, change=None) -> None:
        if self._choosing:
            return  # one update once all three numbers are set
        if self.model.value != CUSTOM and self.shapes[self.model.value] != self._shape():
            self.model.value = CUSTOM
        v = self.values()
        try:
            report = kv_report(v["layers"], v["kv_heads"], v["head_dim"], v["tokens"], v["kv_dtype"],
                               v["group_size"], v["gpu_mem_gb"], v["weights_gb"])
        except ValueError as err:  # e.g. a group size that does not divide head dim: say so in place
            self.result.value = f"cannot compute: {err}"
            return
        self.result.value = summary_line(report)


def kv_calculator(**defaults) -> KVCalculator:
    """Build the calculator (defaults: the article's 80-layer model, i.e. Llama-3.1-70B's shape, 32k
    tokens, two 24 GB GPUs). model="qwen2.5-7b" starts from a stored config."""
    return KVCalculator(**defaults)


class BlockPoolStepper(widgets.VBox):
    """Steps through a script of allocate / append / fork / free on a KVCacheManager and draws the
    block tables and the physical pool after each step (radarlab.viz.pool does the work).

    Buttons: `back_button`, `next_button`, `reset_button` (tests press them with .click()).
    `caption` says what the last step did; `image` holds the PNG drawn from `snapshot`.
    Going back replays the script from the start: the manager is deterministic, so that is exact.
    """

    def __init__(self, script=None, num_blocks: int | None = None, block_size: int | None = None,
                 enable_prefix_caching: bool = True) -> None:
        from radarlab.viz.pool import (
            DEFAULT_POOL,
            DEFAULT_POOL_SCRIPT,
            max_table_rows,
            pool_image_size,
            sequence_colors,
        )

        self.script = tuple(DEFAULT_POOL_SCRIPT if script is None else script)
        self.num_blocks = DEFAULT_POOL["num_blocks"] if num_blocks is None else num_blocks
        self.block_size = DEFAULT_POOL["block_size"] if block_size is None else block_size
        self.enable_prefix_caching = enable_prefix_caching
        ids = [op.seq_id for op in self.script] + [op.arg for op in self.script if op.op == "fork"]
        self.colors = sequence_colors(sorted(set(ids), key=ids.index))
        self.position = 0
        self.back_button = widgets.Button(description="back", icon="step-backward")
        self.next_button = widgets.Button(description="next", icon="step-forward")
        self.reset_button = widgets.Button(description="reset", icon="undo")
        self.back_button.on_click(lambda _: self.go(self.position - 1))
        self.next_button.on_click(lambda _: self.go(self.position + 1))
        self.reset_button.on_click(lambda _: self.go(0))
        self.num_rows = max_table_rows(self.script, self.num_blocks, self.block_size, enable_prefix_caching)
        self.image_size = pool_image_size(self.num_blocks, self.block_size, self.num_rows)
        self.caption = widgets.HTML()
        # Shown at the PNG's own size (1:1, so 9-point token ids stay 9 points), shrunk only on narrow pages.
        self.image = widgets.Image(format="png", width=str(self.image_size[0]),
                                   layout=widgets.Layout(max_width="100%", height="auto"))
        super().__init__([widgets.HBox([self.back_button, self.next_button, self.reset_button]),
                          self.caption, self.image])
        self.go(0)

    def go(self, position: int) -> None:
        """Show the state after the first `position` steps of the script."""
        from radarlab.viz.pool import pool_snapshot, run_pool_script

        position = max(0, min(position, len(self.script)))
        self.state, result = run_pool_script(self.script, self.num_blocks, self.block_size, position,
                                               self.enable_prefix_caching)
        if result is None:
            text = (f"an empty pool of {self.num_blocks} blocks x {self.block_size} slots; "
                    f"press next to run the {len(self.script)} steps")
        else:
            text = result.description
        self.position = position
        # The caption goes in the HTML above the picture only: drawn as the figure's title too, it showed
        # twice.
        self.snapshot = pool_snapshot(self.state, result.copies if result else ())
        self.caption.value = f"<b>step {position}/{len(self.script)}</b>: {html.escape(text)}"
        self.back_button.disabled = position == 0
        self.next_button.disabled = position == len(self.script)
        self.image.value = self.render()

    def figure(self):
        """The current snapshot drawn on a matplotlib Figure (not pyplot: nothing shows twice) of
        image_size pixels, one axes filling it, with room for the script's most block tables: every
        step has the same size, so the page does not jump."""
        from matplotlib.figure import Figure

        from radarlab.viz.pool import RENDER_DPI, draw_pool

        width, height = self.image_size
        fig = Figure(figsize=(width / RENDER_DPI, height / RENDER_DPI), dpi=RENDER_DPI)
        draw_pool(self.snapshot, fig.add_axes((0, 0, 1, 1)), self.colors, num_rows=self.num_rows)
        return fig

    def render(self) -> bytes:
        """The current snapshot as PNG bytes, image_size pixels (no tight bounding box: it would crop
        each step differently)."""
        from radarlab.viz.pool import RENDER_DPI

        buf = io.BytesIO()
        self.figure().savefig(buf, format="png", dpi=RENDER_DPI)
        return buf.getvalue()


def block_pool_stepper(script=None, num_blocks: int | None = None, block_size: int | None = None,
                       enable_prefix_caching: bool = True) -> BlockPoolStepper:
    """Build the pool stepper (default: radarlab.viz.pool.DEFAULT_POOL_SCRIPT on 10 blocks of 4)."""
    return BlockPoolStepper(script, num_blocks, block_size, enable_prefix_caching)


class FP8CodeWalker(widgets.VBox):
    """Walks the 256 codes of an FP8 format: a code slider, back / next buttons and a format toggle;
    the caption says what the bits mean, the picture shows the bits and the code on the number line
    (radarlab.viz.fp8_codes does the work). Every code is drawn on a canvas of the same size."""

    def __init__(self, code: int = 0x38, fmt: str = "e4m3") -> None:
        from radarlab.viz.fp8_codes import FIGURE_DPI, FIGURE_SIZE, FORMAT_NAMES, code_info

        code_info(code, fmt)  # ValueError for a bad code or format, before any control exists
        self.format = widgets.ToggleButtons(options=[(name, key) for key, name in FORMAT_NAMES.items()],
                                            value=fmt,
                                            description="format")
        self.code = widgets.IntSlider(value=code, min=0, max=255, description="code",
                                      layout=widgets.Layout(width="520px"))
        self.back_button = widgets.Button(description="back", icon="step-backward")
        self.next_button = widgets.Button(description="next", icon="step-forward")
        self.back_button.on_click(lambda _: self._move(-1))
        self.next_button.on_click(lambda _: self._move(1))
        self.caption = widgets.HTML()
        width = int(FIGURE_SIZE[0] * FIGURE_DPI)
        self.image = widgets.Image(format="png", width=str(width),
                                   layout=widgets.Layout(max_width="100%", height="auto"))
        self.format.observe(self._update, names="value")
        self.code.observe(self._update, names="value")
        super().__init__([self.format, widgets.HBox([self.code, self.back_button, self.next_button]),
                          self.caption, self.image])
        self._update()

    def _move(self, delta: int) -> None:
        self.code.value = max(0, min(255, self.code.value + delta))

    def _update(self, change=None) -> None:
        from radarlab.viz.fp8_codes import caption, code_info

        self.info = code_info(self.code.value, self.format.value)
        self.caption.value = html.escape(caption(self.info))
        self.back_button.disabled = self.code.value == 0
        self.next_button.disabled = self.code.value == 255
        self.image.value = self.render()

    def render(self) -> bytes:
        """The current code drawn as PNG bytes, always FIGURE_SIZE x FIGURE_DPI pixels (no tight box)."""
        from radarlab.viz.fp8_codes import FIGURE_DPI, code_figure

        buf = io.BytesIO()
        code_figure(self.info).savefig(buf, format="png", dpi=FIGURE_DPI)
        return buf.getvalue()


def fp8_code_walker(code: int = 0x38, fmt: str = "e4m3") -> FP8CodeWalker:
    """Build the code walker, starting at code (default 0x38, E4M3's 1.0) of fmt ("e4m3" or "e5m2")."""
    return FP8CodeWalker(code, fmt)
