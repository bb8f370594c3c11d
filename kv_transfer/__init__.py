"""KV transfer: moves a prompt's paged KV from a prefill worker to a decode worker over torch.distributed."""
