"""What every paged backend does in build(): validate the step's metadata against the pool once."""
from __future__ import annotations

from dataclasses import replace

from radarlab.attention.layout import validate_block_tables, validate_slot_mapping
from radarlab.attention.metadata import AttentionMetadata
from radarlab.quant.rotation import rotate


class PagedBackend:
    """The build step shared by the paged backends; each adds its own per-step plan (plan_step) and
    forward."""

    def is_built(self, meta: AttentionMetadata, kv_cache) -> bool:
        return meta.backend is self and meta.checked_for == kv_cache.geometry

    def build(self, meta: AttentionMetadata, kv_cache, layer: int | None = None) -> AttentionMetadata:
        """Validate once per step (block tables, slot mapping), on the pool's device, stamped with the
        pool's geometry so no layer validates it again; then the backend's plan for the step."""
        if self.is_built(meta, kv_cache):
            return meta
        if meta.slot_mapping is None or meta.block_tables is None:
            missing = [n for n in ("slot_mapping", "block_tables") if getattr(meta, n) is None]
            raise ValueError(f"a paged cache needs AttentionMetadata.{' and '.join(missing)}")
        if meta.checked_for != kv_cache.geometry:
            tensors = (meta.query_start_loc, meta.seq_lens, meta.slot_mapping, meta.block_tables)
            if any(t.device != kv_cache.k.device for t in tensors):
                meta = meta.to(kv_cache.k.device)  # the model runner builds it on the device already
            validate_block_tables(meta.block_tables, meta.seq_lens, kv_cache.num_blocks, kv_cache.block_size)
            validate_slot_mapping(meta.slot_mapping, meta.num_tokens, kv_cache.num_slots)
            meta = replace(meta, checked_for=kv_cache.geometry)
        return self.plan_step(replace(meta, backend=self), kv_cache, layer)

    def plan_step(self, meta: AttentionMetadata, kv_cache, layer: int | None) -> AttentionMetadata:
        return meta

    def forward(self, layer: int, q, k, v, meta: AttentionMetadata, kv_cache, scale: float):
        """Write and attend (the subclass's attend); a rotated format rotates K (stored) and q by the
        same orthogonal matrix, and with `vrot` V too and the output back, on every backend."""
        kv_cache.check_kv(layer, k, v)
        if kv_cache.rotation is None:
            return self.attend(layer, q, k, v, meta, kv_cache, scale)
        q, k = rotate(q, kv_cache.rotation), rotate(k, kv_cache.rotation)
        if not kv_cache.kv_format.rotate_values:
            return self.attend(layer, q, k, v, meta, kv_cache, scale)
        out = self.attend(layer, q, k, rotate(v, kv_cache.rotation), meta, kv_cache, scale)
        return rotate(out, kv_cache.rotation.T)  # o' = softmax(.) (V R), so o = o' R^T, per head
