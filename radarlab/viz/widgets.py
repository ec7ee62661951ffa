"""Interactive controls for the notebooks. The arithmetic lives in radarlab (here: kvcache.memory), so
tests can change a control's value in plain Python and read the label, with no browser involved."""
from __future__ import annotations

import ipywidgets as widgets

from radarlab.kvcache.memory import KV_DTYPES, kv_report, summary_line


class KVCalculator(widgets.VBox):
    """A KV-cache calculator: model shape, context, format and GPU in; bytes, GB and streams out.

    `controls` maps each input's name (kv_report's parameter names) to its widget; `result` is the
    Label that shows the one-line answer, or what is wrong with the inputs."""

    def __init__(self, layers: int = 80, kv_heads: int = 8, head_dim: int = 128, tokens: int = 32768,
                 kv_dtype: str = "fp16", group_size: int = 128, gpu_mem_gb: float = 48.0,
                 weights_gb: float = 0.0) -> None:
        style = {"description_width": "110px"}
        layout = widgets.Layout(width="420px")
        self.controls = {
            "layers": widgets.IntSlider(value=layers, min=1, max=128, description="layers", style=style, layout=layout),
            "kv_heads": widgets.IntSlider(value=kv_heads, min=1, max=64, description="KV heads", style=style, layout=layout),
            "head_dim": widgets.Dropdown(options=sorted({64, 80, 96, 128, 256, head_dim}), value=head_dim,
                                         description="head dim", style=style),
            "tokens": widgets.IntSlider(value=tokens, min=1, max=max(131072, tokens), step=1,
                                        description="tokens", style=style, layout=layout),
            "kv_dtype": widgets.Dropdown(options=list(KV_DTYPES), value=kv_dtype, description="KV dtype", style=style),
            "group_size": widgets.Dropdown(options=sorted({16, 32, 64, 128, group_size}), value=group_size,
                                           description="int4 group", style=style),
            "gpu_mem_gb": widgets.BoundedFloatText(value=gpu_mem_gb, min=0.0, max=10000.0, step=1.0,
                                                   description="GPU memory GB", style=style),
            "weights_gb": widgets.BoundedFloatText(value=weights_gb, min=0.0, max=10000.0, step=1.0,
                                                   description="weights GB", style=style),
        }
        self.result = widgets.Label(layout=widgets.Layout(width="auto"))
        for control in self.controls.values():
            control.observe(self._update, names="value")
        super().__init__(list(self.controls.values()) + [self.result])
        self._update()

    def values(self) -> dict:
        return {name: control.value for name, control in self.controls.items()}

    def _update(self, change=None) -> None:
        v = self.values()
        try:
            report = kv_report(v["layers"], v["kv_heads"], v["head_dim"], v["tokens"], v["kv_dtype"],
                               v["group_size"] if v["kv_dtype"] == "int4" else None,
                               v["gpu_mem_gb"], v["weights_gb"])
        except ValueError as err:  # e.g. a group size that does not divide head dim: say so in place
            self.result.value = f"cannot compute: {err}"
            return
        self.result.value = summary_line(report)


def kv_calculator(**defaults) -> KVCalculator:
    """Build the calculator (defaults: the article's 80-layer model, 32k tokens, two 24 GB GPUs)."""
    return KVCalculator(**defaults)
