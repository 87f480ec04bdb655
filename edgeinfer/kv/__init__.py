"""The paged KV layer: block pool, layer groups, block tables, prefix cache, context shift, pool sizing, VRAM storage."""
