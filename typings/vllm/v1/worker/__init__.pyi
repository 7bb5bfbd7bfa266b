# Stubs for the parts of vLLM 0.33.0 pdkv's adapter and its tests use (typing only; see README).
