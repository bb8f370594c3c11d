"""Prefill worker: chunked prefill over a paged KV cache, handing each prompt's KV to kv_transfer."""
