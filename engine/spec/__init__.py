"""Speculative decoding: drafters (EAGLE-3 head, n-gram) and the lossless verifier."""
