# Stubs for the parts of SGLang 0.5.23 that pdkv.adapters.sglang and its tests touch.
