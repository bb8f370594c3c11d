"""Decode worker: continuous-batching decode with MagicDec-style speculative decoding."""
